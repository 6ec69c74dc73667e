"""HTTP routes, one module per concern: `jobs` (the /v1 job API), `ops` (health, metrics).

main.py includes them; errors they raise become HTTP responses there, in one place.
"""

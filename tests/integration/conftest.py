"""Integration fixtures: `ray_local`, `engine_pool` and `make_job` live in tests/conftest.py,
shared with tests/chaos/ so that one session starts one Ray and one pool of warm engines.
"""

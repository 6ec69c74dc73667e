"""hsx's benchmarks: each a module run from the repository's root, `python -m benchmarks.X`.

A package, so that the scripts import their shared helpers (`benchmarks.common`,
`benchmarks.cpu_profile`, one another's writers) and the tests' fixtures
(`tests.unit.outputs`, `tests.s3server`) as modules, without editing `sys.path`.
"""

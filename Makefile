# The two commands of the README's quick start, and the checks CI runs.
# Each target builds .venv first if needed (scripts/setup-env.sh; a second run is fast).
PY := .venv/bin

.PHONY: env demo test test-slow lint reference docs dist unit integration bench clean

env:
	@bash scripts/setup-env.sh

demo: env
	$(PY)/hsx demo

# Two workers, a test module on one (tests/conftest.py orders the longest first), each
# worker and what it starts on its own half of the cores (tests/conftest.py says why).
XDIST := -n 2 --dist loadfile --no-loadscope-reorder

test: env lint docs
	$(PY)/pytest $(XDIST)

# The long end-to-end runs (every architecture, the long fuzz, TP=2 on CPU, the live
# dashboard): over CI's time budget together with the rest.
test-slow: env
	$(PY)/pytest -m slow

lint: env
	$(PY)/ruff check .
	$(PY)/mypy

# The reference pages (docs/reference/, the settings of docs/guides/operations.md) are
# generated from the code and committed, so the repository's web view shows them whole:
# `make reference` writes them (scripts/reference.py).
reference: env
	$(PY)/python scripts/reference.py

# The docs site into site/, after checking that the committed reference pages are what
# the code generates (as a lockfile is checked): strict, so a broken link, anchor or
# missing page fails.
docs: env
	$(PY)/python scripts/reference.py --check
	NO_MKDOCS_2_WARNING=1 $(PY)/mkdocs build --strict

# The sdist and the wheel into $(DIST) (the wheel from the sdist, so the sdist is proven
# whole), with this environment's setuptools: no download. The distribution is
# `hsx-hidden-states` (`hsx` on PyPI is another project); it installs the `hsx` command
# and `import hsx`. tests/unit/test_packaging.py builds and installs it.
DIST := dist

dist: env
	rm -f $(DIST)/hsx_hidden_states-*
	$(PY)/python -m build --quiet --no-isolation --outdir $(DIST) .

unit: env
	$(PY)/pytest tests/unit

integration: env
	$(PY)/pytest tests/integration

bench: env
	$(PY)/python -m benchmarks.run_all

clean:
	rm -rf demo-output site dist .pytest_cache .mypy_cache .ruff_cache

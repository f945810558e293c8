# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: install install-dev demo test test-newest-python triton-compat lint bench

install:
	$(PIP) -e .

install-dev:
	$(PIP) -e ".[dev]"

demo: install
	$(PY) -m circuits_llm demo

test: install-dev
	$(PY) -m pytest -q -p no:cacheprovider

# the suite under the newest Python on this machine, with and without triton (own venv)
test-newest-python:
	bash scripts/test_python.sh

# every kernel compiled to cubin for sm_80/sm_90 under several triton releases
TRITON_VERSIONS ?= 3.6.0 3.7.1 3.9.0
triton-compat: install-dev
	PY=$(PY) bash scripts/triton_compat.sh $(TRITON_VERSIONS)

lint: install-dev
	$(PY) -m ruff check circuits circuits_llm tests benchmarks

bench: install
	$(PY) -m benchmarks.circuits_bench

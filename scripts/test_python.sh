#!/usr/bin/env bash
# Runs the test suite under another Python, in its own virtual environment, twice: with the
# test install (triton included where it has wheels), then with triton uninstalled, so that the
# suite is shown to pass both with and without it.
#   scripts/test_python.sh [PYTHON]
# Without PYTHON: the newest Python on this machine for which torch (constraints.txt) has a wheel;
# a newer one without a wheel is named and skipped. The venv is kept in
# ${CIRCUITS_VENVS:-~/.cache/circuits-llm/venvs} and reused; on Python != 3.11
# `pip install torch==2.13.0` downloads torch's CUDA build (about 4.7 GB; it runs on the CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
venvs=${CIRCUITS_VENVS:-$HOME/.cache/circuits-llm/venvs}
PIP_QUIET=(--quiet --disable-pip-version-check)

# prepare_venv PYTHON: prints the venv's python once torch is installed in it, or fails
prepare_venv() {
  local python=$1 version venv
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv="$venvs/py$version"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >&2
  "$venv/bin/python" -m pip install "${PIP_QUIET[@]}" -c constraints.txt torch >&2 || return 1
  echo "$venv/bin/python"
}

if [ $# -gt 0 ]; then
  venv_python=$(prepare_venv "$1")
else
  venv_python=""
  while read -r python; do
    if venv_python=$(prepare_venv "$python"); then break; fi
    echo "test_python.sh: no installable torch (constraints.txt) for $python; trying an older Python" >&2
    venv_python=""
  done < <(scripts/newest_python.sh --all)
  [ -n "$venv_python" ] || { echo "test_python.sh: no Python >= 3.10 with a torch wheel" >&2; exit 2; }
fi
version=$("$venv_python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
echo "== test suite under Python $version ($venv_python)"
make --no-print-directory test PY="$venv_python"
if "$venv_python" -c 'import triton' 2>/dev/null; then
  echo "== the same suite under Python $version without triton"
  "$venv_python" -m pip uninstall "${PIP_QUIET[@]}" --yes triton
  status=0
  "$venv_python" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-auto}" --maxprocesses 8 \
    || status=$?
  # put it back so the venv matches the test install again
  "$venv_python" -m pip install "${PIP_QUIET[@]}" -c constraints.txt -e ".[dev]"
  exit $status
fi

#!/usr/bin/env bash
# Runs the version-sensitive tests (`-m version_sensitive`, tests/version_sensitive.txt) under
# another Python, in its own virtual environment, twice: with the test install (triton included
# where it has wheels), then with triton uninstalled, so that what can differ is shown to pass
# both with and without it. `make test` runs the whole suite once on the README's Python.
#   scripts/test_python.sh [--all] [PYTHON]     (--all: the whole suite, both times)
# Without PYTHON: the newest Python on this machine for which torch (constraints.txt) has a wheel;
# a newer one without a wheel is named and skipped. The venv is kept in
# ${CIRCUITS_VENVS:-~/.cache/circuits-llm/venvs}/pyX.Y and reused: the test install
# (`make install-dev demo-model`) runs only when pyproject.toml, constraints.txt, the Makefile or
# the checkout's path changed since the last one (a stamp in the venv). On Python != 3.11 the
# first `pip install torch==2.13.0` downloads torch's CUDA build (about 4.7 GB; it runs on the CPU).
# Fails when a test fails, or when the marker selects no test (pytest's exit status 5).
set -euo pipefail
cd "$(dirname "$0")/.."
venvs=${CIRCUITS_VENVS:-$HOME/.cache/circuits-llm/venvs}
PIP_QUIET=(--quiet --disable-pip-version-check)
CONSTRAINTS=constraints.txt
what="the version-sensitive tests"
run_tests() { make --no-print-directory test-version-sensitive PY="$1"; }
if [ "${1:-}" = "--all" ]; then
  shift
  what="the whole suite"
  run_tests() { "$1" -m pytest -q -p no:cacheprovider -n "${PYTEST_WORKERS:-auto}" --maxprocesses 8; }
fi

# prepare_venv PYTHON: prints the venv's python once torch is installed in it, or fails
prepare_venv() {
  local python=$1 version venv
  version=$("$python" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  venv="$venvs/py$version"
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv" >&2
  if ! "$venv/bin/python" -c 'import torch' 2>/dev/null; then
    "$venv/bin/python" -m pip install "${PIP_QUIET[@]}" -c "$CONSTRAINTS" torch >&2 || return 1
  fi
  echo "$venv/bin/python"
}

# the test install, skipped when the stamp says this checkout's install is already there
install_key() {
  { cat pyproject.toml "$CONSTRAINTS" Makefile; pwd; } | sha256sum | cut -c1-16
}
ensure_test_install() {
  local py=$1 stamp key
  stamp="$(dirname "$(dirname "$py")")/.circuits-test-install"
  key=$(install_key)
  if [ "$(cat "$stamp" 2>/dev/null)" = "$key" ]; then
    echo "== test install up to date ($stamp)"
    return
  fi
  rm -f "$stamp"
  make --no-print-directory install-dev demo-model PY="$py" CONSTRAINTS="$CONSTRAINTS"
  echo "$key" > "$stamp"
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
ensure_test_install "$venv_python"
version=$("$venv_python" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])')
failed=()
with_triton=no
if "$venv_python" -c 'import triton' 2>/dev/null; then with_triton=yes; fi
echo "== $what under Python $version ($venv_python)$([ $with_triton = yes ] && echo ", with triton")"
run_tests "$venv_python" || failed+=("$([ $with_triton = yes ] && echo "with triton" || echo "the test install")")
if [ $with_triton = yes ]; then
  echo "== $what under Python $version without triton"
  stamp="$(dirname "$(dirname "$venv_python")")/.circuits-test-install"
  key=$(cat "$stamp")
  # the installed triton's wheel is kept beside the venvs (downloaded once, before uninstalling),
  # so that putting it back after the run is a local install of that one package
  wheels="$venvs/wheels"
  triton_version=$("$venv_python" -c 'import triton; print(triton.__version__)')
  tag=$("$venv_python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
  if ! compgen -G "$wheels/triton-$triton_version-$tag-*.whl" >/dev/null; then
    "$venv_python" -m pip download "${PIP_QUIET[@]}" --no-deps -d "$wheels" "triton==$triton_version"
  fi
  rm -f "$stamp"  # the venv is not the test install until triton is back
  "$venv_python" -m pip uninstall "${PIP_QUIET[@]}" --yes triton
  run_tests "$venv_python" || failed+=("without triton")
  "$venv_python" -m pip install "${PIP_QUIET[@]}" --no-deps --no-index --find-links "$wheels" \
    "triton==$triton_version"
  echo "$key" > "$stamp"
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "test_python.sh: $what fail under Python $version: $(IFS=,; echo "${failed[*]}")" >&2
  exit 1
fi

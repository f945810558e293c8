#!/usr/bin/env bash
# Compiles every triton kernel for sm_80 and sm_90 (through ptx and cubin, no GPU needed) under
# several triton releases: tests/test_kernels_cubin.py with each release put first on the path.
#   scripts/triton_compat.sh [VERSION ...]   (default: 3.6.0 3.7.1 3.9.0)
# 3.6 and 3.7.1 are the releases torch 2.11 and 2.13 pin; 3.9.0 was the newest when written.
# CI (.ci/run) passes only 3.9.0: its other steps compile with 3.7.1 (`make test`, the newest
# Python) and 3.6 (`make test-floors`, beside torch 2.11), tests/test_kernels_cubin.py being
# version-sensitive. Compiled kernels are cached by triton (~/.triton/cache): a release whose
# kernels did not change since the last run compiles in seconds, else about 2.5 min on 2 cores.
# Each release is installed once into ${CIRCUITS_TRITONS:-~/.cache/circuits-llm/tritons}/VERSION
# with pip --target (the wheels are 200-400 MB) beside the interpreter's own torch.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(3.6.0 3.7.1 3.9.0)
store=${CIRCUITS_TRITONS:-$HOME/.cache/circuits-llm/tritons}
failed=()
for version in "${versions[@]}"; do
  target="$store/$version"
  if [ ! -f "$target/.complete" ]; then
    rm -rf "$target"
    "$PY" -m pip install --quiet --disable-pip-version-check --no-deps --target "$target" \
      "triton==$version"
    touch "$target/.complete"
  fi
  found=$(PYTHONPATH="$target" "$PY" -c 'import triton; print(triton.__version__)')
  [ "$found" = "$version" ] || { echo "triton_compat.sh: wanted triton $version, got $found" >&2; exit 2; }
  echo "== triton $version: every kernel to cubin for sm_80 and sm_90"
  PYTHONPATH="$target" TRITON_INTERPRET=0 "$PY" -m pytest -q -p no:cacheprovider \
    tests/test_kernels_cubin.py || failed+=("$version")
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "triton_compat.sh: kernels fail to compile under triton ${failed[*]}" >&2
  exit 1
fi
echo "triton_compat.sh: every kernel compiles under triton ${versions[*]}"

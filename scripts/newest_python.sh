#!/usr/bin/env bash
# Prints the path of the newest CPython >= 3.10 on this machine (pyenv's versions, then PATH),
# newest first when given --all. Used by `make test-newest-python` and .ci/run.
set -euo pipefail
candidates=()
if command -v pyenv >/dev/null 2>&1; then
  root=$(pyenv root)
  for py in "$root"/versions/*/bin/python3; do [ -x "$py" ] && candidates+=("$py"); done
fi
for minor in 10 11 12 13 14 15; do
  py=$(command -v "python3.$minor" 2>/dev/null || true)
  [ -n "$py" ] && candidates+=("$py")
done
for py in "${candidates[@]}"; do
  # "3.13.0 /path": only final CPython releases, no free-threaded or pre-release builds
  "$py" -c 'import sys, sysconfig
ok = sys.implementation.name == "cpython" and sys.version_info >= (3, 10) \
    and sys.version_info.releaselevel == "final" and not sysconfig.get_config_var("Py_GIL_DISABLED")
print("%d.%02d.%03d %s" % (*sys.version_info[:3], sys.executable) if ok else "")' 2>/dev/null || true
done | sort -r | awk 'NF && !seen[$1]++ {print $2}' | { if [ "${1:-}" = "--all" ]; then cat; else head -n 1; fi }

#!/usr/bin/env bash
# One command from a fresh clone: system packages, .venv, then the whole test suite.
# Extra arguments go to pytest (e.g. scripts/test.sh -k crash).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/sysdeps.sh"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
set +e
"$ROOT/.venv/bin/python" -m pytest -q "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
    echo "no tests were collected: failing" >&2
    exit 1
fi
exit $rc

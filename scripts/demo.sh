#!/usr/bin/env bash
# One command from a fresh clone: set up .venv and run `tierstore demo` on ./demo-store.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/tierstore" demo "$@"

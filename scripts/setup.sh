#!/usr/bin/env bash
# Creates .venv (if missing) with torch and tierstore installed. Sourced by demo.sh and test.sh.
# On a machine without an NVIDIA GPU it installs the CPU build of torch and never pulls CUDA.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
PY="${PYTHON:-python3}"

have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }

stamp="$VENV/.tierstore-installed"
want="$(cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" | cksum | cut -d' ' -f1)-$(have_gpu && echo gpu || echo cpu)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    return 0 2>/dev/null || exit 0
fi

echo "setting up $VENV ..." >&2
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip --disable-pip-version-check "$@"; }
pip install -q --upgrade pip setuptools wheel

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if have_gpu; then
        pip install -q torch
    else
        # A local CPU wheel (pip's find-links) if the machine has one, else PyTorch's CPU index.
        local_whl="$(ls "${PIP_FIND_LINKS:-/opt/wheels}"/torch-*+cpu-*.whl 2>/dev/null | sort -V | tail -n 1 || true)"
        if [ -n "$local_whl" ]; then
            ver="$(basename "$local_whl" | cut -d- -f2 | cut -d+ -f1)"
            pip install -q "torch==$ver"
        else
            pip install -q torch --index-url https://download.pytorch.org/whl/cpu
        fi
    fi
fi

extras="dev"
have_gpu && extras="dev,gpu"
pip install -q -e "$ROOT[$extras]"
echo "$want" > "$stamp"

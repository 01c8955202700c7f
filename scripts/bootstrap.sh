#!/usr/bin/env bash
# Set up .venv from nothing, idempotently: a virtual environment, torch (the CPU build unless a
# GPU is present; never CUDA wheels on a CPU machine), then truefuse with its dev and bench extras.
# Re-running it is cheap: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.9"
  else
    # On our machines this exact version resolves to the CPU build (DESIGN §8).
    pip install -q "torch==2.13.0"
  fi
fi

stamp=.venv/.truefuse-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip install -q -e ".[dev,bench]"
  echo "$want" > "$stamp"
fi

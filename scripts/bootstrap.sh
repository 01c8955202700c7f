#!/usr/bin/env bash
# Set up .venv from nothing, idempotently: a virtual environment, torch (the CPU build unless a
# GPU is present; never CUDA wheels on a CPU machine), then truefuse with its dev, bench, hf and rl extras.
# Re-running it is cheap: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip() { .venv/bin/python -m pip "$@"; }

if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # NumPy before torch: torch's wheels do not require it, and torch imported without it (the CUDA
  # build check below) warns "Failed to initialize NumPy"; truefuse's extras need it anyway.
  pip install -q numpy
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q "torch>=2.9"
  else
    # The CPU build from PyTorch's own CPU wheel index. PIP_CONFIG_FILE=/dev/null keeps pip's
    # configured mirrors out of this one call: where a mirror holds a newer torch it is the CUDA
    # build (5.5 GB with its nvidia-* packages). Wheels in PIP_FIND_LINKS still count.
    if ! PIP_CONFIG_FILE=/dev/null pip install -q --timeout 10 --retries 1 \
        --index-url https://download.pytorch.org/whl/cpu "torch>=2.9" >.venv/torch-cpu-index.log 2>&1; then
      echo "bootstrap: PyTorch's CPU wheel index could not be reached (.venv/torch-cpu-index.log); torch==2.13.0 from pip's own sources" >&2
      # this version is a CPU build where a local CPU wheel exists (our machines); plain "torch"
      # would take the CUDA build there
      pip install -q "torch==2.13.0"
    fi
    if .venv/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is None)"; then
      echo "bootstrap: warning: a CUDA build of torch was installed on a machine without a GPU" >&2
    fi
  fi
fi

stamp=.venv/.truefuse-installed
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  pip install -q -e ".[dev,bench,hf,rl]"
  echo "$want" > "$stamp"
fi

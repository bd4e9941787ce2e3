#!/usr/bin/env bash
# Create the virtual environment and install dspark-serve with its dev extras.
# On machines without CUDA, the CPU build of torch is installed first so that resolving the
# project's `torch>=...` requirement never pulls a multi-GB CUDA build. On GPU machines, install
# the torch build matching your CUDA first (see README), then run this script: it keeps that torch.
set -euo pipefail
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
CPU_TORCH="${DSPARK_CPU_TORCH:-torch==2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "CUDA GPU found: installing the default (CUDA) torch build"
    "$VENV/bin/python" -m pip install -q torch
  else
    echo "no CUDA GPU: installing the CPU torch build ($CPU_TORCH)"
    "$VENV/bin/python" -m pip install -q "$CPU_TORCH"
  fi
fi
"$VENV/bin/python" -m pip install -q -e ".[dev]"
"$VENV/bin/dspark" version

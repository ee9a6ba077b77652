#!/usr/bin/env bash
# Installs what the project needs into the current Python, idempotently.
# torch first: on a machine without it, the CPU build (torch==2.13.0) is taken explicitly, because a
# plain "torch" requirement would pull a multi-GB CUDA build. A machine that has torch keeps its own.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q torch==2.13.0
fi
"$PY" -m pip install -q -e ".[dev]"
# Triton: a CUDA machine uses the one its torch came with. On a CPU-only torch, the kernels are tested
# through Triton's interpreter, and 3.9.0's runs loops whose bound is loaded from memory (3.6.0's not).
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  "$PY" -c "import triton, sys; sys.exit(0 if triton.__version__ == '3.9.0' else 1)" 2>/dev/null \
    || "$PY" -m pip install -q triton==3.9.0
fi

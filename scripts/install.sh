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

#!/usr/bin/env bash
# Installs what the project needs into the current Python, idempotently, through the lock
# (requirements/cpu.txt, refreshed by scripts/lock.sh): every version a user's first run installs is
# one that the tests have met.
# - A machine without torch (a CPU machine, CI) gets the locked CPU build of torch (2.13.0+cpu, from
#   PyTorch's CPU wheel index: a plain "torch" from PyPI would be a multi-GB CUDA build) and the locked
#   Triton, whose interpreter runs the kernels' tests on CPU.
# - A machine that has torch (a GPU runner, the device) keeps its torch and Triton; the lock constrains
#   everything else. A CPU-only torch without the locked Triton still gets that Triton.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
lock=requirements/cpu.txt
torch_index=(--extra-index-url https://download.pytorch.org/whl/cpu --retries 1)
if ! "$PY" -c "import torch" 2>/dev/null; then
  # torch alone from there (its needs come with the project below, through the lock, from the usual
  # index): where PyTorch's index cannot be reached, pip says so once, not once for each of them.
  "$PY" -m pip install -q --no-deps -c "$lock" "${torch_index[@]}" torch
fi
# The lock less torch and triton, so that a machine's own builds of those two stay as they are.
others=$(mktemp)
trap 'rm -f "$others"' EXIT
grep -v -E '^(torch|triton)==' "$lock" >"$others"
"$PY" -m pip install -q -c "$others" -e ".[dev]"
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
  triton_locked=$(sed -n 's/^triton==//p' "$lock")
  "$PY" -c "import triton, sys; sys.exit(0 if triton.__version__ == sys.argv[1] else 1)" "$triton_locked" 2>/dev/null \
    || "$PY" -m pip install -q -c "$lock" triton
fi

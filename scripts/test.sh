#!/usr/bin/env bash
# The project's test command (CI runs it through .ci/run): set-up, lint, types, workflow lint, unit
# tests, the Triton kernels through the interpreter, then the perf tier's smoke profile (tiny model on CPU, against the stored CPU result).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
actionlint
python3 -m pytest tests/unit -q "$@"
# Triton kernels on CPU through the interpreter (read when triton is imported: its own invocation).
TRITON_INTERPRET=1 python3 -m pytest tests/unit/kernels -q
python3 -m pytest -m perf --profile smoke --model tiny --trials 1 -q -rs

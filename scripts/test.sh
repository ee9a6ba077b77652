#!/usr/bin/env bash
# The project's test command (CI runs it through .ci/run): set-up, lint, types, workflow lint, unit
# tests, then the perf tier's smoke profile (tiny model on CPU, against the stored CPU result).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
actionlint
python3 -m pytest tests/unit -q "$@"
python3 -m pytest -m perf --profile smoke --model tiny --trials 1 -q -rs

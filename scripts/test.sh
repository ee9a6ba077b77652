#!/usr/bin/env bash
# Set-up, lint, types, unit tests: the project's test command (CI runs this through .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m ruff check .
python3 -m ruff format --check .
python3 -m mypy
python3 -m pytest tests/unit -q "$@"

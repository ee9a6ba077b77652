#!/usr/bin/env bash
# Set-up, then the main job: the benchmark end to end. Without a GPU: the tiny preset on CPU against
# this project's server (smoke profile); with a GPU: the full profile on qwen2.5-1.5b. Prints the
# summary table and writes perf-out/report.html. Extra arguments go to pytest (e.g. --target both).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
python3 -m pytest -m perf -rs "$@"
echo "report: perf-out/report.html; summaries: perf-out/*-seed-mix.json, perf-out/*-seed-mix-sampled.json"

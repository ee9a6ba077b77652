#!/usr/bin/env bash
# Set-up, then the main job: write the tiny synthetic checkpoint and generate from it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
MODEL=${MODEL:-models/tiny}
[ -f "$MODEL/config.json" ] || python3 -m engine.synthetic --preset tiny --out "$MODEL"
python3 -m engine --model "$MODEL" --prompt "the quick brown fox" --max-tokens 32 --temperature 0

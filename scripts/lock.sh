#!/usr/bin/env bash
# Refreshes requirements/cpu.txt, the lock every CPU install (a user's first run, CI) goes through:
# pip-tools resolves pyproject.toml's dev extra and requirements/cpu.in (the CPU build of torch, the
# Triton of the kernels' interpreter tests) to exact versions. Run it, then the tests, and commit the
# lock with the change that needed it; .github/workflows/lock.yml does the same every week.
# PyTorch's CPU wheel index is consulted so that torch resolves to its CPU build (2.13.0+cpu) and
# brings none of the CUDA build's packages; where that index cannot be reached, pip's own configured
# sources must offer the CPU build (pip warns and carries on).
# usage: scripts/lock.sh [extra pip-compile flags, e.g. --upgrade-package NAME]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install -q "pip-tools>=7.4"
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$PY" -m piptools compile --quiet --extra dev --strip-extras --no-emit-index-url --no-emit-find-links \
  --extra-index-url https://download.pytorch.org/whl/cpu --pip-args "--retries 1" \
  --output-file requirements/cpu.txt "$@" pyproject.toml requirements/cpu.in
# The dev extra names the project itself (paged-engine[server,bench]); pip-compile pins that as this
# checkout's path, which no other checkout has: the project is installed from its own folder, not the lock.
sed -i '/^paged-engine @ /,/^[^ ]/{/^paged-engine @ /d;/^    #/d}' requirements/cpu.txt
echo "wrote requirements/cpu.txt ($(grep -c '==' requirements/cpu.txt) packages)"

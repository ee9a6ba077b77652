#!/usr/bin/env bash
# A decode attention change against a base commit on one GPU, in one call that ends inside a budget:
# the kernel benchmark beside the base's kernel (`bench_attention --against`), the kernel's GPU
# tests, then in-process closed loops (`scripts/option_trials.sh`) of this tree and the base at 128
# and at 1 in flight. Each step runs only if the budget still holds it, so a short call still returns
# the kernel figures first. Logs and JSON go to OUT_DIR.
#
# Why one call: device time comes in short leases on machines that differ by up to 40%; a kernel's
# figures and the engine's only compare within one lease. The land rule for a decode kernel change:
# one sequence (1 x 1,024, 1 x 4,096) and 256 x 1,024 within ~3% of the base, and the closed loop at
# 128 in flight no slower.
#
# usage: scripts/kernel_ab.sh OUT_DIR     (here first: scripts/base_tree.sh prepare BASE; carry .base-tree)
# The machine's Python needs the project's dependencies (bench imports httpx and aiohttp): where its
# image lacks them, install their wheels into a folder and put it on PYTHONPATH first.
# env:   BUDGET (seconds, default 500), MODEL (a model folder, default /tmp/qwen: made if missing),
#        AGAINST (another decode_attention.py to time beside this one at the end, optional),
#        GPU_TESTS (the tests run with -m gpu; default both decode kernels' tests and the engine's test
#        that serving compiles no kernel variant after start-up)
# Exit status 0 when every step that ran passed, 1 otherwise, 2 for bad usage.
set -uo pipefail
cd "$(dirname "$0")/.."
[ $# -eq 1 ] || { echo "usage: scripts/kernel_ab.sh OUT_DIR" >&2; exit 2; }
out=$1
[ -f .base-tree/ref.txt ] || { echo "error: no .base-tree: run scripts/base_tree.sh prepare BASE here first" >&2; exit 2; }
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" \
  || { echo "error: no CUDA device: this script times GPU kernels" >&2; exit 2; }
python3 -c "import bench.__main__, pytest" \
  || { echo "error: this Python cannot import bench (install the project's dependencies, or put a folder of their wheels' contents on PYTHONPATH)" >&2; exit 2; }
mkdir -p "$out"
export PYTHONUNBUFFERED=1
model=${MODEL:-/tmp/qwen}
budget=${BUDGET:-500}
started=$SECONDS
status=0
left() { echo $((budget - (SECONDS - started))); }
within() {  # SECONDS: a step's timeout, no more than what is left (and at least 1: `timeout 0` never ends)
  local remaining
  remaining=$(left)
  ((remaining > $1)) && remaining=$1
  echo $((remaining > 0 ? remaining : 1))
}
mark() { echo "[t=$((SECONDS - started))s] $*"; }
base=$(mktemp -d)/base
if [ ! -f "$model/config.json" ]; then
  python3 -m engine.synthetic --preset qwen2.5-1.5b --out "$model" --dtype bfloat16 >"$out/synth.log" 2>&1 &
  synth=$!
fi
bash scripts/base_tree.sh build "$base"
mark "kernel benchmark against the base's kernel"
timeout "$(within 100)" python3 -m engine.kernels.bench_attention --json "$out/bench-attention.json" \
  --against "$base/engine/kernels/decode_attention.py" 2>&1 | grep -v "^ *shared among" || status=1
mark "GPU tests of the kernel"
# shellcheck disable=SC2086  # GPU_TESTS is a list of paths
default_tests="tests/unit/kernels/test_*decode_attention.py tests/unit/engine/test_gpu.py::test_serving_compiles_no_kernel_after_start_up"
if ! timeout "$(within 200)" python3 -m pytest ${GPU_TESTS:-$default_tests} \
  -q -x -m gpu -p no:cacheprovider >"$out/gpu-tests.txt" 2>&1; then
  tail -5 "$out/gpu-tests.txt"
  echo "the kernel fails its GPU tests: no closed loops"
  exit 1
fi
tail -1 "$out/gpu-tests.txt"
[ -z "${synth:-}" ] || wait "$synth" || { echo "error: the model folder could not be made" >&2; exit 1; }
for level in 128 1; do
  # a run is an engine start (~25 s) and its warm-up besides the DURATION of new requests
  if [ "$(left)" -lt $((level == 128 ? 110 : 80)) ]; then
    mark "no time left for $level in flight"
    continue
  fi
  mark "closed loops at $level in flight, this tree then the base"
  CONCURRENCY=$level DURATION=$((level == 128 ? 12 : 8)) WARMUP=$((level == 128 ? 64 : 4)) DISCARD_FIRST=0 \
    RUN_TIMEOUT=$((level == 128 ? 100 : 60)) bash scripts/option_trials.sh "$model" "$out/closed$level" '' "tree=$base" \
    2>&1 | grep -v "^  offline\|^level\|regression" || status=1
done
if [ -n "${AGAINST:-}" ] && [ "$(left)" -gt 40 ]; then
  mark "kernel benchmark against $AGAINST"
  timeout "$(within 45)" python3 -m engine.kernels.bench_attention --json "$out/bench-attention-against.json" \
    --against "$AGAINST" 2>&1 | grep "against" || status=1
fi
mark done
exit $status

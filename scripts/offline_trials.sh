#!/usr/bin/env bash
# Offline figures of both targets on one machine, one after the other, each in a process of its own
# with the GPU to itself: `python -m bench offline` (all requests at once, then the two probes) for
# vLLM when it can be imported here or PERF_VLLM_ENV names a staged one, then for the engine; then
# `bench compare` of the two, and the engine's step profile at 1, 64 and 256 sequences.
#
# usage: scripts/offline_trials.sh MODEL_DIR OUT_DIR
# env:   TARGETS ("vllm engine"), DTYPE (bfloat16; float32 for the engine on CPU),
#        N_REQUESTS (1000), OFFLINE_ARGS (more `bench offline` flags, e.g. smaller probes on CPU),
#        PROFILE (1; 0 skips the profile), PROFILE_ARGS (more `engine.profile` flags),
#        PERF_VLLM_ENV (a staged vLLM's env file; see bench/launch.py), CUDA_VISIBLE_DEVICES
# Writes OUT_DIR/TARGET/run.json (its `offline` section) and requests.csv, OUT_DIR/TARGET.log,
# OUT_DIR/compare.md (engine against vLLM), OUT_DIR/profile.json and profile.txt.
# Exit status 0 when every step that ran succeeded, 1 otherwise (the others still run), 2 for bad usage.
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: scripts/offline_trials.sh MODEL_DIR OUT_DIR}
out=${2:?usage: scripts/offline_trials.sh MODEL_DIR OUT_DIR}
if [ ! -f "$model/config.json" ]; then
  echo "error: $model is not a model folder (make one with: python -m engine.synthetic --preset qwen2.5-1.5b --out DIR --dtype bfloat16)" >&2
  exit 2
fi
mkdir -p "$out"
status=0

vllm_unavailable() {  # prints why vLLM cannot run here, nothing when it can
  python3 -c 'from bench.launch import vllm_unavailable_reason; print(vllm_unavailable_reason() or "")'
}

for target in ${TARGETS:-vllm engine}; do
  if [ "$target" = vllm ]; then
    reason=$(vllm_unavailable)
    if [ -n "$reason" ]; then
      echo "== vllm: not run: $reason"
      continue
    fi
  fi
  echo "== $target: python -m bench offline (log: $out/$target.log)"
  # shellcheck disable=SC2086  # OFFLINE_ARGS is a list of flags
  if python3 -m bench offline --target "$target" --model "$model" --dtype "${DTYPE:-bfloat16}" \
    --n-requests "${N_REQUESTS:-1000}" --out "$out/$target" ${OFFLINE_ARGS:-} >"$out/$target.log" 2>&1; then
    grep -v '^\[bench offline worker\]' "$out/$target.log" | tail -n 4
  else
    echo "$target failed:"
    tail -n 20 "$out/$target.log"
    status=1
  fi
done

if [ -f "$out/vllm/run.json" ] && [ -f "$out/engine/run.json" ]; then
  # Exit status 1 here only says the engine is slower than vLLM: the table is what is wanted.
  python3 -m bench compare "$out/vllm" "$out/engine" --format markdown >"$out/compare.md"
  echo "== engine against vLLM: $out/compare.md"
  grep -E '^\| offline (all|probes) \| (output_tok_s|single_tpot_s|prefill_tok_s) ' "$out/compare.md"
fi

if [ "${PROFILE:-1}" != 0 ] && [[ " ${TARGETS:-vllm engine} " == *" engine "* ]]; then
  echo "== engine: python -m engine.profile (output: $out/profile.txt)"
  # shellcheck disable=SC2086  # PROFILE_ARGS is a list of flags
  if python3 -m engine.profile --model "$model" --json "$out/profile.json" ${PROFILE_ARGS:-} >"$out/profile.txt" 2>&1; then
    grep -E '^(decode step|  moved|  GPU busy|  host per step)' "$out/profile.txt"
  else
    echo "profile failed:"
    tail -n 20 "$out/profile.txt"
    status=1
  fi
fi
exit $status

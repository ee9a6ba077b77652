#!/usr/bin/env bash
# Engine option sets against each other in process (no HTTP), one engine at a time on one machine: a
# closed loop of CONCURRENCY seed-mix requests (`python -m bench offline --concurrency`) for each set,
# in ROUNDS rounds ordered A B C..., then ...C B A, then A B C... (a steady drift of the machine favours
# no set), and `bench compare` of each set's run against the first set's run of the same round.
#
# Why: a tuning option (the mixed-step graphs' ladder or largest size, the token budget, the sequence
# cap) changes what every step of a closed loop runs; in process its figures carry no HTTP noise, the
# step phases say where a change went, and an engine started for each run keeps each set's graphs and
# memory its own.
#
# usage: scripts/option_trials.sh MODEL_DIR OUT_DIR SET [SET...]
#   SET: space-separated NAME=VALUE engine options (EngineArgs fields); '' is the defaults. E.g.
#   scripts/option_trials.sh /tmp/qwen out '' 'mixed_graph_ladder_steps=8' 'mixed_graph_max_tokens=8192'
#   tree=DIR in a set runs it from another source tree (a copy of this one with a kernel's tile, say,
#   changed: no git needed; `scripts/base_tree.sh` rebuilds a commit's tree), with the same model and
#   output folders:
#   scripts/option_trials.sh /tmp/qwen out '' 'tree=/tmp/tile64' 'tree=/tmp/tile64 max_num_seqs=512'
# A discarded run of the first set comes before round 1 (DISCARD_FIRST=0 leaves it out): on a fresh
# machine the first engine run's host phases ran 20-40% slower (schedule 0.35 vs 0.25 ms a step, an H100
# of 2026-12-06), which would fall on whichever set runs first.
# env:   CONCURRENCY (128), DURATION (20: seconds of new requests), WARMUP (64 requests), ROUNDS (1),
#        DTYPE (bfloat16; float32 for the engine on CPU), OFFLINE_ARGS (more `bench offline` flags,
#        e.g. --prefill-prompts 64 for the prefill probe too), RUN_TIMEOUT (300 s a run)
# Writes OUT_DIR/rR-K/ (run.json, requests.csv) and OUT_DIR/rR-K.log for round R and set K (1 is the
# first; r0-1 is the discarded run), OUT_DIR/compare-rR-K.txt, and OUT_DIR/sets.txt (K and its options).
# Exit status 0 when every run succeeded, 1 otherwise (the others still run), 2 for bad usage.
set -uo pipefail
cd "$(dirname "$0")/.."
model=${1:?usage: scripts/option_trials.sh MODEL_DIR OUT_DIR SET [SET...]}
out=${2:?usage: scripts/option_trials.sh MODEL_DIR OUT_DIR SET [SET...]}
shift 2
here=$PWD
if [ $# -lt 1 ]; then
  echo "usage: scripts/option_trials.sh MODEL_DIR OUT_DIR SET [SET...] ('' is the defaults)" >&2
  exit 2
fi
if [ ! -f "$model/config.json" ]; then
  echo "error: $model is not a model folder (make one with: python -m engine.synthetic --preset qwen2.5-1.5b --out DIR --dtype bfloat16)" >&2
  exit 2
fi
sets=("$@")
for set in "${sets[@]}"; do
  for option in $set; do
    case $option in tree=*)
      if [ ! -f "${option#tree=}/bench/__main__.py" ]; then
        echo "error: ${option#tree=} is not a source tree of this project (no bench/__main__.py)" >&2
        exit 2
      fi
    esac
  done
done
mkdir -p "$out"
: >"$out/sets.txt"
for k in "${!sets[@]}"; do echo "$((k + 1)) ${sets[$k]:-(defaults)}" >>"$out/sets.txt"; done
status=0

# Run from another tree: the model and output folders as absolute paths.
model=$(cd "$model" && pwd)
out=$(cd "$out" && pwd)

run_set() {  # ROUND K
  local round=$1 k=$2 name="r$1-$(($2 + 1))" options=() tree=$here
  for option in ${sets[$k]}; do
    case $option in
      tree=*) tree=${option#tree=} ;;
      *) options+=(--option "$option") ;;
    esac
  done
  # shellcheck disable=SC2086  # OFFLINE_ARGS is a list of flags
  (cd "$tree" && timeout "${RUN_TIMEOUT:-300}" python3 -m bench offline --target engine --model "$model" \
    --dtype "${DTYPE:-bfloat16}" --n-requests 0 --concurrency "${CONCURRENCY:-128}" \
    --duration "${DURATION:-20}" --warmup "${WARMUP:-64}" --single-tokens 0 --prefill-prompts 0 \
    ${OFFLINE_ARGS:-} "${options[@]}" --out "$out/$name") >"$out/$name.log" 2>&1
  local rc=$?
  if [ "$round" -eq 0 ]; then echo "discarded warm-up run, set 1 (${sets[$k]:-defaults}): rc $rc"
  else echo "round $round, set $((k + 1)) (${sets[$k]:-defaults}): rc $rc"; fi
  grep -E "^closed-|^prefill" "$out/$name.log" | sed 's/^/  /'
  [ $rc -eq 0 ] || status=1
}

if [ "${DISCARD_FIRST:-1}" != 0 ]; then
  run_set 0 0  # written as r0-1: not compared, not a round
fi
for round in $(seq 1 "${ROUNDS:-1}"); do
  order=("${!sets[@]}")
  if [ $((round % 2)) -eq 0 ]; then  # even rounds in reverse
    reversed=(); for ((i = ${#order[@]} - 1; i >= 0; i--)); do reversed+=("${order[$i]}"); done
    order=("${reversed[@]}")
  fi
  for k in "${order[@]}"; do run_set "$round" "$k"; done
  for k in "${!sets[@]}"; do
    [ "$k" -eq 0 ] && continue
    base="$out/r$round-1/run.json" new="$out/r$round-$((k + 1))/run.json"
    [ -f "$base" ] && [ -f "$new" ] || continue
    python3 -m bench compare "$base" "$new" >"$out/compare-r$round-$((k + 1)).txt" 2>&1
    echo "round $round: set $((k + 1)) against set 1 (bench compare, exit $?)"
    sed 's/^/  /' "$out/compare-r$round-$((k + 1)).txt" | head -30
  done
done
exit $status

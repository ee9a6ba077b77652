#!/usr/bin/env bash
# One trial of the perf tier for each target, the two side by side on their own GPUs of one host,
# against servers started once (`python -m bench serve`) and left running between invocations.
#
# Why: a stored baseline wants several trials, vLLM takes ~2 minutes to start, and one full-profile
# trial of vLLM takes ~5 minutes on an H200; where commands are time-limited, each invocation runs one
# trial of both targets and the trials are folded afterwards:
#   scripts/perf_trials.sh t1; scripts/perf_trials.sh t2; scripts/perf_trials.sh t3
#   python -m bench merge perf-out/t*/vllm/vllm-seed-mix.json --out baselines/<gpu>/<model>/vllm-seed-mix.json
# With PERF_K=sweep (only the sweeps), fold them in with `bench merge ... --sweep-from perf-out/s*/...`.
# The two targets share the host's CPUs while they run; the trials' spread shows what that costs.
# With ONE_GPU=1 the targets take turns on GPU 0 instead, each with the GPU and the host to itself:
# start its server, its trial, stop it (a server holding ~90% of the GPU's memory leaves no room for
# the other), in the order of TARGETS; each invocation then pays each server's start.
#
# usage: scripts/perf_trials.sh NAME [MODEL] [PROFILE]   (defaults: qwen2.5-1.5b, full)
# env:   VLLM_GPU (0), ENGINE_GPU (1), TARGETS ("vllm engine"), ONE_GPU (0; 1: one target at a time on GPU 0),
#        KEEP_SERVER (with ONE_GPU=1: 1 leaves the last target's server up for the next invocation, which
#        reuses it; a target's server starts only after every other target's is stopped),
#        PERF_TIMEOUT (seconds per trial; 0, the default, for none),
#        PERF_K (a pytest -k expression: only those cases),
#        PERF_TRIALS (trials a target per invocation, 1 by default: more against one server start, where a
#        start costs minutes (vLLM's) and the trials need not alternate with the other target's),
#        PERF_DTYPE (bfloat16; float32 for the engine on CPU), PERF_VLLM_ENV (a staged vLLM's env file; see bench/launch.py)
# Writes perf-out/NAME/TARGET/ (summary JSON, benchmark JSON, report) and perf-out/NAME/TARGET.log.
set -uo pipefail
cd "$(dirname "$0")/.."
name=${1:?usage: scripts/perf_trials.sh NAME [MODEL] [PROFILE]}
model=${2:-qwen2.5-1.5b}
profile=${3:-full}
root=perf-out
folder=$root/models/$model
mkdir -p "$root/$name"

if [ ! -f "$folder/config.json" ]; then
  if [ -d "$model" ]; then folder=$model; else
    python3 -m engine.synthetic --preset "$model" --out "$folder" --dtype bfloat16 || exit 2
  fi
fi

serving() {  # the description exists and its server answers /health
  python3 -c 'import sys; from bench.launch import healthy, load_server_info
try: sys.exit(0 if healthy(str(load_server_info(sys.argv[1])["base_url"]), 5.0) else 1)
except ValueError: sys.exit(1)' "$1"
}

gpu_of() {
  if [ "${ONE_GPU:-0}" = 1 ]; then echo 0
  elif [ "$1" = engine ]; then echo "${ENGINE_GPU:-1}"
  else echo "${VLLM_GPU:-0}"; fi
}

start_server() {  # TARGET: unless its server is up already
  local target=$1 info=$root/$1-server.json
  serving "$info" && return 0
  CUDA_VISIBLE_DEVICES=$(gpu_of "$target") python3 -m bench serve --target "$target" --model "$folder" \
    --dtype "${PERF_DTYPE:-bfloat16}" --info "$info" --log "$root/$target-server.log"
}

trial() {  # TARGET: one trial against its running server
  local target=$1
  mkdir -p "$root/$name/$target"
  CUDA_VISIBLE_DEVICES=$(gpu_of "$target") timeout "${PERF_TIMEOUT:-0}" python3 -m pytest -m perf tests/perf \
    --target "$target" --server-info "$root/$target-server.json" --model "$(basename "$model")" \
    --profile "$profile" --trials "${PERF_TRIALS:-1}" --perf-out "$root/$name/$target" \
    --benchmark-json "$root/$name/$target/benchmark.json" -q -rs -p no:cacheprovider ${PERF_K:+-k "$PERF_K"}
}

report() {  # TARGET: the tier's closing table of its trial (the client's warnings first; the checks a
  # reference without the level skipped are counted in the budgets line, not listed: they would push
  # the figures off the 20 lines)
  echo "== $1 (exit status in log: $root/$name/$1.log)"
  sed -n '/perf: figures and budgets/,$p' "$root/$name/$1.log" | grep -v ': skipped, the reference has no ' | tail -n 20
}

stop_others() {  # TARGET: every other target's server left up by an earlier invocation (KEEP_SERVER=1)
  local info
  for info in "$root"/*-server.json; do
    [ -f "$info" ] && [ "$info" != "$root/$1-server.json" ] && serving "$info" && python3 -m bench stop --info "$info"
  done
  return 0
}

if [ "${ONE_GPU:-0}" = 1 ]; then
  status=0
  targets=(${TARGETS:-vllm engine})
  for i in "${!targets[@]}"; do
    target=${targets[$i]}
    stop_others "$target"
    start_server "$target" >"$root/$name/$target-start.log" 2>&1 || { cat "$root/$name/$target-start.log"; exit 3; }
    cat "$root/$name/$target-start.log"
    trial "$target" >"$root/$name/$target.log" 2>&1 || status=1
    if [ "${KEEP_SERVER:-0}" != 1 ] || [ "$i" -lt $(( ${#targets[@]} - 1 )) ]; then
      python3 -m bench stop --info "$root/$target-server.json"
    fi
    report "$target"
  done
  exit $status
fi

# All servers first, then the trials side by side: a trial never shares the host with a server's start.
pids=()
for target in ${TARGETS:-vllm engine}; do
  start_server "$target" >"$root/$name/$target-start.log" 2>&1 &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { cat "$root/$name/"*-start.log; exit 3; }; done
cat "$root/$name/"*-start.log
pids=()
for target in ${TARGETS:-vllm engine}; do
  trial "$target" >"$root/$name/$target.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
for target in ${TARGETS:-vllm engine}; do report "$target"; done
exit $status

#!/usr/bin/env bash
# Does bench agree with vLLM's own benchmark client? Against one server that is already running, run
# bench's `fixed` workload (one closed-loop level) and `vllm bench serve --dataset-name random` of the
# same shape alternately, bench first (A B A B A B), after one short bench run that warms the server up
# and is discarded; then `python -m bench fidelity-summary` writes each run's figures, each client's
# medians and bench's gap to vLLM's client in percent (README, "Fidelity to vLLM's benchmark client").
#
# Start the server first, as the perf tier does, and run this once per server, each into its own folder:
#   python -m bench serve --target engine --model MODEL_DIR --port 8001    # ours; prints the pid to stop
#   bash .vllm-stage/p2/serve.sh MODEL_DIR 8000                            # staged vLLM (or bench serve --target vllm)
#   PERF_VLLM_ENV=.vllm-stage/p2/env.sh scripts/fidelity.sh MODEL_DIR OUT/vllm http://127.0.0.1:8000/v1
#   PERF_VLLM_ENV=.vllm-stage/p2/env.sh scripts/fidelity.sh MODEL_DIR OUT/engine http://127.0.0.1:8001/v1
#
# usage: scripts/fidelity.sh MODEL_DIR OUT_DIR BASE_URL   (BASE_URL with the /v1 prefix)
# env:   RUNS (3 of each client), N_REQUESTS (200), CONCURRENCY (32), INPUT_LEN (1024), OUTPUT_LEN (128),
#        WARMUP_REQUESTS (64; 0 skips the warm-up run), WORKERS (1: bench's client processes),
#        TOLERANCE_PCT (2), LABEL (the server's name in the summary; default: the URL),
#        BENCH_ARGS, VLLM_ARGS (more flags for either client),
#        PERF_VLLM_ENV (a staged vLLM's env file, sourced for the vllm command only; see bench/launch.py)
# MODEL_DIR gives vLLM's client its tokenizer (it builds text prompts of exactly INPUT_LEN tokens).
# Writes OUT_DIR/runs/N-bench/ (run.json, requests.csv), OUT_DIR/runs/N-vllm.json, a log per run
# (OUT_DIR/runs/N-CLIENT.log), OUT_DIR/warmup/, and OUT_DIR/fidelity.json.
# Exit status: 0 when the medians of output tokens/s agree within TOLERANCE_PCT, 1 when they do not,
# 2 for bad usage or no server at BASE_URL, 3 when vLLM's client is not available here (bench's runs are
# made and summarized, nothing is compared), 4 when a run failed.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/fidelity.sh MODEL_DIR OUT_DIR BASE_URL"
model=${1:?$usage}
out=${2:?$usage}
base_url=${3:?$usage}
base_url=${base_url%/}
runs=${RUNS:-3}
if [ ! -f "$model/config.json" ]; then
  echo "error: $model is not a model folder" >&2
  exit 2
fi
if ! python3 -c 'import sys; from bench.launch import healthy; sys.exit(0 if healthy(sys.argv[1], 5.0) else 1)' "$base_url"; then
  echo "error: no server answers ${base_url%/v1}/health; start one first (see the top of this script)" >&2
  exit 2
fi
served=$(python3 -c 'import sys; from bench.probe import first_model; print(first_model(sys.argv[1]))' "$base_url") || exit 2
mkdir -p "$out/runs"

vllm_unavailable() {  # prints why vLLM's benchmark client cannot run here, nothing when it can
  local check='import vllm.benchmarks.serve'
  if [ -n "${PERF_VLLM_ENV:-}" ]; then
    [ -f "$PERF_VLLM_ENV" ] || { echo "PERF_VLLM_ENV=$PERF_VLLM_ENV is not a file"; return; }
    bash -c 'source "$0" && exec python3 -c "$1"' "$PERF_VLLM_ENV" "$check" >/dev/null 2>&1 ||
      echo "vllm.benchmarks.serve does not import after sourcing $PERF_VLLM_ENV"
  else
    python3 -c "$check" >/dev/null 2>&1 ||
      echo "vLLM is not installed here: pip install vllm, or set PERF_VLLM_ENV to a staged site's env file"
  fi
}

# The two clients' commands; shown in the summary as they ran. The vllm one gets the env file sourced
# in a shell of its own, so nothing of the staged site (its PYTHONPATH) reaches bench or the server.
bench_cmd=(python3 -m bench run --base-url "$base_url" --model "$served" --workload fixed
  --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-128}" --concurrency "${CONCURRENCY:-32}"
  --n-requests "${N_REQUESTS:-200}" --workers "${WORKERS:-1}" --quiet)
# --temperature 0: bench asks for greedy decoding; without it vLLM's client leaves sampling to the
# server's default (temperature 1). ignore_eos is implied by the random dataset, and given anyway.
vllm_cmd=(python3 -m vllm.entrypoints.cli.main bench serve --backend openai --base-url "${base_url%/v1}"
  --endpoint /v1/completions --model "$served" --tokenizer "$model" --dataset-name random
  --random-input-len "${INPUT_LEN:-1024}" --random-output-len "${OUTPUT_LEN:-128}"
  --num-prompts "${N_REQUESTS:-200}" --max-concurrency "${CONCURRENCY:-32}" --ignore-eos --temperature 0
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,99 --disable-tqdm --save-result)
# shellcheck disable=SC2206  # BENCH_ARGS and VLLM_ARGS are lists of flags
bench_cmd+=(${BENCH_ARGS:-})
# shellcheck disable=SC2206
vllm_cmd+=(${VLLM_ARGS:-})

run_vllm() {  # RESULT_FILE: one vllm bench serve run
  local folder file
  folder=$(dirname "$1") file=$(basename "$1")
  if [ -n "${PERF_VLLM_ENV:-}" ]; then
    bash -c 'source "$0" && exec "$@"' "$PERF_VLLM_ENV" "${vllm_cmd[@]}" --result-dir "$folder" --result-filename "$file"
  else
    "${vllm_cmd[@]}" --result-dir "$folder" --result-filename "$file"
  fi
}

reason=$(vllm_unavailable)
[ -n "$reason" ] && echo "== vllm bench serve: not run: $reason"

status=0
if [ "${WARMUP_REQUESTS:-64}" -gt 0 ]; then
  echo "== warm-up (discarded): bench, ${WARMUP_REQUESTS:-64} requests (log: $out/warmup.log)"
  python3 -m bench run --base-url "$base_url" --model "$served" --workload fixed \
    --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-128}" --concurrency "${CONCURRENCY:-32}" \
    --n-requests "${WARMUP_REQUESTS:-64}" --quiet --out "$out/warmup" >"$out/warmup.log" 2>&1 ||
    { echo "warm-up failed:"; tail -n 20 "$out/warmup.log"; exit 4; }
fi

order=0
summary_args=()
for trial in $(seq 1 "$runs"); do
  order=$((order + 1))
  echo "== run $order: bench ($trial of $runs; log: $out/runs/$order-bench.log)"
  if "${bench_cmd[@]}" --out "$out/runs/$order-bench" >"$out/runs/$order-bench.log" 2>&1; then
    summary_args+=("bench=$out/runs/$order-bench")
  else
    echo "bench failed:"; tail -n 20 "$out/runs/$order-bench.log"; status=4
  fi
  [ -n "$reason" ] && continue
  order=$((order + 1))
  echo "== run $order: vllm bench serve ($trial of $runs; log: $out/runs/$order-vllm.log)"
  if run_vllm "$out/runs/$order-vllm.json" >"$out/runs/$order-vllm.log" 2>&1 && [ -f "$out/runs/$order-vllm.json" ]; then
    summary_args+=("vllm=$out/runs/$order-vllm.json")
  else
    echo "vllm bench serve failed:"; tail -n 20 "$out/runs/$order-vllm.log"; status=4
  fi
done

[ ${#summary_args[@]} -gt 0 ] || exit 4
python3 -m bench fidelity-summary "${summary_args[@]}" --out "$out/fidelity.json" \
  --label "${LABEL:-$base_url}" --tolerance "${TOLERANCE_PCT:-2}" \
  --bench-command "${bench_cmd[*]} --out $out/runs/N-bench" \
  --vllm-command "${PERF_VLLM_ENV:+source $PERF_VLLM_ENV && }${vllm_cmd[*]} --result-dir $out/runs --result-filename N-vllm.json"
summary_status=$?
if [ $status -ne 0 ]; then exit $status; fi
exit $summary_status

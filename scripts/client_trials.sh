#!/usr/bin/env bash
# vLLM's own benchmark client (`vllm bench serve`) against each target's server, one server at a time
# on one GPU: start it (`python -m bench serve`), one discarded warm-up run, RUNS measured runs with the
# given flags, stop it; then a table of each run's output tokens/s, TPOT p50 and TTFT p50 and each
# target's medians. This is how a user with a client this project did not write sees the two servers
# (e.g. with no --temperature: the client's default, sampled at the server's temperature 1.0).
#
# usage: scripts/client_trials.sh MODEL_DIR OUT_DIR [vllm bench serve flags...]
#   e.g. scripts/client_trials.sh /tmp/qwen OUT --dataset-name random --random-input-len 1024 \
#          --random-output-len 128 --num-prompts 300 --max-concurrency 64 --ignore-eos
# env:   TARGETS ("vllm engine"), RUNS (2), WARMUP_PROMPTS (64), PERF_VLLM_ENV (a staged vLLM's env
#        file, sourced for vLLM's server and client only; see bench/launch.py), DTYPE (bfloat16),
#        CONCURRENCIES (e.g. "64 256": each run is repeated at each --max-concurrency, on one server
#        start; the flags then should not give --max-concurrency themselves), SERVER_ARGS (more flags
#        for every target's server, e.g. "--api-server-count=2")
# Writes OUT_DIR/TARGET[-cC]-N.json (vLLM's result files), OUT_DIR/TARGET-server.log, OUT_DIR/summary.json
# (by target, and by concurrency where CONCURRENCIES is set). Each run also records the CPU seconds
# the server's whole process tree spent (API processes and engine core, either target's), reported
# per 1,000 output tokens.
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/client_trials.sh MODEL_DIR OUT_DIR [vllm bench serve flags...]"
model=${1:?$usage}
out=${2:?$usage}
shift 2
mkdir -p "$out"
vllm_client() {  # FLAGS...: vLLM's client, with the staged site's env file sourced in its own shell
  local cmd=(python3 -m vllm.entrypoints.cli.main bench serve --backend openai --endpoint /v1/completions
    --tokenizer "$model" --disable-tqdm --save-result --percentile-metrics ttft,tpot,itl,e2el
    --metric-percentiles 50,99 "$@")
  if [ -n "${PERF_VLLM_ENV:-}" ]; then bash -c 'source "$0" && exec "$@"' "$PERF_VLLM_ENV" "${cmd[@]}"; else "${cmd[@]}"; fi
}
tree_cpu() {  # PID: CPU seconds of the process and its descendants so far
  python3 -c 'import sys; from bench.host_cost import process_tree_cpu_seconds as t; print(t(int(sys.argv[1])))' "$1"
}
server_args=()
for flag in ${SERVER_ARGS:-}; do server_args+=("--server-arg=$flag"); done
status=0
for target in ${TARGETS:-vllm engine}; do
  info=$out/$target-server.json
  echo "== $target: starting its server"
  if ! python3 -m bench serve --target "$target" --model "$model" --dtype "${DTYPE:-bfloat16}" \
    --info "$info" --log "$out/$target-server.log" "${server_args[@]}" >"$out/$target-start.log" 2>&1; then
    tail -n 30 "$out/$target-start.log" "$out/$target-server.log"; status=3; continue
  fi
  base_url=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["base_url"])' "$info")
  pid=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["pid"])' "$info")
  served=$(python3 -c 'import sys; from bench.probe import first_model; print(first_model(sys.argv[1]))' "$base_url")
  common=(--base-url "${base_url%/v1}" --model "$served")
  vllm_client "${common[@]}" "$@" --num-prompts "${WARMUP_PROMPTS:-64}" --result-dir "$out" \
    --result-filename "$target-warmup.json" >"$out/$target-warmup.log" 2>&1 || { tail -n 30 "$out/$target-warmup.log"; status=4; }
  for concurrency in ${CONCURRENCIES:-default}; do
    level=() tag=$target
    if [ "$concurrency" != default ]; then level=(--max-concurrency "$concurrency") tag=$target-c$concurrency; fi
    for run in $(seq 1 "${RUNS:-2}"); do
      echo "== $tag: run $run"
      cpu_before=$(tree_cpu "$pid")
      vllm_client "${common[@]}" "$@" "${level[@]}" --result-dir "$out" --result-filename "$tag-$run.json" \
        >"$out/$tag-$run.log" 2>&1 || { tail -n 30 "$out/$tag-$run.log"; status=4; }
      python3 -c 'import sys; print(float(sys.argv[2]) - float(sys.argv[1]))' "$cpu_before" "$(tree_cpu "$pid")" \
        >"$out/$tag-$run.cpu"
    done
  done
  python3 -m bench stop --info "$info"
done
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
tags = sorted({p.name.rsplit("-", 1)[0] for p in out.glob("*-[0-9]*.json")} - {"vllm-warmup", "engine-warmup"})
for target in tags:
    runs = []
    for path in sorted(out.glob(f"{target}-[0-9]*.json")):
        data = json.loads(path.read_text())
        cpu = path.with_suffix(".cpu")
        cpu_s = float(cpu.read_text()) if cpu.exists() else float("nan")
        runs.append({"run": path.name, "output_tok_s": data["output_throughput"], "tpot_p50_ms": data["median_tpot_ms"],
                     "ttft_p50_ms": data["median_ttft_ms"], "completed": data["completed"], "failed": data.get("failed", 0),
                     "server_cpu_s": cpu_s, "server_cpu_s_per_1k_tokens": 1000 * cpu_s / data["total_output_tokens"]})
    if runs:
        summary[target] = {"runs": runs, **{k: statistics.median(r[k] for r in runs) for k in
                                            ("output_tok_s", "tpot_p50_ms", "ttft_p50_ms", "server_cpu_s_per_1k_tokens")}}
(out / "summary.json").write_text(json.dumps(summary, indent=1))
for target, entry in summary.items():
    for r in entry["runs"]:
        print(f"{target:7s} {r['run']:16s} {r['output_tok_s']:9.1f} tok/s  TPOT p50 {r['tpot_p50_ms']:6.2f} ms  TTFT p50 {r['ttft_p50_ms']:7.1f} ms  "
              f"server CPU {r['server_cpu_s_per_1k_tokens']:.3f} s/1k tokens  completed {r['completed']} failed {r['failed']}")
for tag in summary:
    if tag.startswith("engine") and "vllm" + tag[len("engine"):] in summary:
        engine, vllm = summary[tag], summary["vllm" + tag[len("engine"):]]
        print(f"{tag} / vLLM output tok/s: {engine['output_tok_s'] / vllm['output_tok_s']:.3f}; "
              f"TPOT p50 {engine['tpot_p50_ms'] / vllm['tpot_p50_ms']:.3f}")
PY
exit $status

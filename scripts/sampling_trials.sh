#!/usr/bin/env bash
# Sampled against greedy decoding, offline (`python -m bench offline`, no HTTP), on one GPU: each mode
# in turn, ROUNDS times over (greedy, sampled, nucleus, greedy, ...; a drift favours none), each run
# N prompts of INPUT_LEN tokens generating OUTPUT_LEN all at once, then one sequence alone.
#   greedy:  temperature 0
#   sampled: temperature 1.0 (top-k and top-p off: the OpenAI API's default)
#   nucleus: temperature 1.0, top_p 0.95 (what a typical chat client sends)
# Prints each run and each mode's medians as ratios to greedy; writes OUT_DIR/MODE-ROUND/ (run.json)
# and OUT_DIR/summary.json.
#
# usage: scripts/sampling_trials.sh MODEL_DIR OUT_DIR
# env:   TARGET (engine; vllm through PERF_VLLM_ENV), ROUNDS (2), N (64), INPUT_LEN (1024),
#        OUTPUT_LEN (128), SINGLE_TOKENS (256), DTYPE (bfloat16), MODES ("greedy sampled nucleus")
set -uo pipefail
cd "$(dirname "$0")/.."
usage="usage: scripts/sampling_trials.sh MODEL_DIR OUT_DIR"
model=${1:?$usage}
out=${2:?$usage}
mkdir -p "$out"
status=0
for round in $(seq 1 "${ROUNDS:-2}"); do
  for mode in ${MODES:-greedy sampled nucleus}; do
    case $mode in
      greedy) flags=(--temperature 0) ;;
      sampled) flags=(--temperature 1.0) ;;
      nucleus) flags=(--temperature 1.0 --top-p 0.95) ;;
      *) echo "unknown mode $mode" >&2; exit 2 ;;
    esac
    echo "== ${TARGET:-engine} $mode, round $round"
    python3 -m bench offline --target "${TARGET:-engine}" --model "$model" --dtype "${DTYPE:-bfloat16}" \
      --workload fixed --input-len "${INPUT_LEN:-1024}" --output-len "${OUTPUT_LEN:-128}" \
      --max-model-len $(( ${INPUT_LEN:-1024} + ${OUTPUT_LEN:-128} + ${SINGLE_TOKENS:-256} )) \
      --n-requests "${N:-64}" --warmup 16 --single-tokens "${SINGLE_TOKENS:-256}" --prefill-prompts 0 \
      "${flags[@]}" --out "$out/$mode-$round" >"$out/$mode-$round.log" 2>&1 \
      || { tail -n 30 "$out/$mode-$round.log"; status=4; }
  done
done
python3 - "$out" <<'PY'
import json, statistics, sys
from pathlib import Path
out = Path(sys.argv[1])
summary = {}
for run in sorted(out.glob("*-[0-9]*/run.json")):
    mode = run.parent.name.rsplit("-", 1)[0]
    offline = json.loads(run.read_text())["offline"]
    entry = summary.setdefault(mode, {"output_tok_s": [], "single_tpot_ms": []})
    entry["output_tok_s"].append(offline["all"]["output_tok_s"])
    entry["single_tpot_ms"].append(offline["probes"]["single_tpot_s"] * 1e3)
for mode, entry in summary.items():
    entry["median_output_tok_s"] = statistics.median(entry["output_tok_s"])
    entry["median_single_tpot_ms"] = statistics.median(entry["single_tpot_ms"])
greedy = summary.get("greedy")
for mode, entry in summary.items():
    line = f"{mode:8s} all at once {entry['output_tok_s']} tok/s, one sequence {[round(t, 3) for t in entry['single_tpot_ms']]} ms/token"
    if greedy:
        entry["ratio_output_tok_s"] = entry["median_output_tok_s"] / greedy["median_output_tok_s"]
        entry["ratio_single_tpot"] = entry["median_single_tpot_ms"] / greedy["median_single_tpot_ms"]
        line += f"; vs greedy {entry['ratio_output_tok_s']:.3f}x throughput, {entry['ratio_single_tpot']:.3f}x time per token"
    print(line)
(out / "summary.json").write_text(json.dumps(summary, indent=1))
PY
exit $status

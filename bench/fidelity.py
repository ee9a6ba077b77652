"""Does bench agree with vLLM's own benchmark client? Fold alternating runs of both into one summary.

`scripts/fidelity.sh` runs `python -m bench run` (the `fixed` workload, one closed-loop level) and
`vllm bench serve --dataset-name random` of the same shape against one running server, alternately,
and calls `python -m bench fidelity-summary`, which is `summarize_runs` here: each run's figures in
bench's keys and units (seconds), each client's medians, and bench's gap to vLLM's client in percent.
Bench run folders are read with bench.results; vLLM's result JSON (`--save-result`) is read here.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.results import load_result, read_rows

CLIENTS = ("bench", "vllm")
# The figures compared, in bench's keys; seconds for latencies.
FIGURES = (
    "output_tok_s",
    "served_req_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_p50_s",
    "itl_p50_s",
    "e2e_p50_s",
    "duration_s",
    "completed",
    "failures",
    "output_tokens",
    "prompt_tokens_mean",
    "client_cpu_util",  # bench's self-check (vLLM's client has none): was the client busy?
    "client_loop_lag_p99_s",
)
# vLLM's result key for each figure, and the factor to bench's unit.
VLLM_KEYS = {
    "output_tok_s": ("output_throughput", 1.0),
    "served_req_s": ("request_throughput", 1.0),
    "ttft_p50_s": ("median_ttft_ms", 1e-3),
    "ttft_p99_s": ("p99_ttft_ms", 1e-3),
    "tpot_p50_s": ("median_tpot_ms", 1e-3),
    "itl_p50_s": ("median_itl_ms", 1e-3),
    "e2e_p50_s": ("median_e2el_ms", 1e-3),
    "duration_s": ("duration", 1.0),
    "completed": ("completed", 1.0),
    "failures": ("failed", 1.0),
    "output_tokens": ("total_output_tokens", 1.0),
}
DEFAULT_TOLERANCE_PCT = 2.0


@dataclass(frozen=True)
class Run:
    """One run, in the order the runs were made: which client, and where its result is."""

    client: str  # "bench" or "vllm"
    path: str

    @classmethod
    def parse(cls, text: str) -> Run:
        """`bench=DIR` (a `bench run` folder or its run.json) or `vllm=FILE` (`vllm bench serve`'s JSON)."""
        client, equals, path = text.partition("=")
        if not equals or client not in CLIENTS or not path:
            raise ValueError(f"expected bench=PATH or vllm=PATH, got {text!r}")
        return cls(client, path)


def bench_figures(path: str | Path) -> dict[str, float]:
    """The figures of a `bench run` folder that ran one closed-loop level (its first level)."""
    result = load_result(path)
    if not result.levels:
        raise ValueError(f"{path}: no level in this run")
    level = result.levels[0]
    figures = {key: float(level[key]) for key in FIGURES if key in level}
    folder = Path(path) if Path(path).is_dir() else Path(path).parent
    ok = [row for row in read_rows(folder) if row.ok and not row.warmup]
    figures["output_tokens"] = float(sum(row.output_tokens for row in ok))
    prompts = [row.usage_prompt_tokens for row in ok if row.usage_prompt_tokens is not None]
    figures["prompt_tokens_mean"] = statistics.fmean(prompts) if prompts else math.nan
    return figures


def vllm_figures(path: str | Path) -> dict[str, float]:
    """The figures of `vllm bench serve --save-result` (its JSON), converted to bench's keys and units."""
    data = json.loads(Path(path).read_text())
    if "output_throughput" not in data:
        raise ValueError(f"{path}: not a `vllm bench serve` result (no output_throughput)")
    figures = {
        key: float(data[name]) * factor if data.get(name) is not None else math.nan
        for key, (name, factor) in VLLM_KEYS.items()
    }
    completed = data.get("completed") or 0
    figures["prompt_tokens_mean"] = data["total_input_tokens"] / completed if completed else math.nan
    return figures


def gap_pct(ours: float, theirs: float) -> float:
    """How far bench's figure is from vLLM's client's, in percent of vLLM's: (bench - vllm) / vllm."""
    if not (math.isfinite(ours) and math.isfinite(theirs)) or theirs == 0:
        return math.nan
    return (ours - theirs) / theirs * 100.0


def summarize_runs(
    runs: Sequence[Run],
    tolerance_pct: float = DEFAULT_TOLERANCE_PCT,
    commands: dict[str, str] | None = None,
    label: str | None = None,
) -> dict[str, Any]:
    """Per-run figures (in run order), each client's medians, and the gap of bench's medians to vLLM's.

    `agree` is true when the medians of output tokens/s are within `tolerance_pct` of each other, false
    when they are not, and None when one client has no run (nothing was compared).
    """
    per_run: list[dict[str, Any]] = []
    for order, run in enumerate(runs, start=1):
        read = bench_figures if run.client == "bench" else vllm_figures
        per_run.append({"order": order, "client": run.client, "path": run.path, **read(run.path)})
    medians: dict[str, dict[str, float]] = {}
    for client in CLIENTS:
        mine = [entry for entry in per_run if entry["client"] == client]
        if mine:
            medians[client] = {
                key: statistics.median(values)
                for key in FIGURES
                if (values := [entry[key] for entry in mine if math.isfinite(entry.get(key, math.nan))])
            }
    gaps: dict[str, float] = {}
    if len(medians) == 2:
        gaps = {
            key: gap_pct(medians["bench"][key], medians["vllm"][key])
            for key in FIGURES
            if key in medians["bench"] and key in medians["vllm"]
        }
    output_gap = gaps.get("output_tok_s", math.nan)
    return {
        "kind": "fidelity",
        "label": label,
        "tolerance_pct": tolerance_pct,
        "agree": None if math.isnan(output_gap) else abs(output_gap) <= tolerance_pct,
        "gap_pct": gaps,
        "medians": medians,
        "runs": per_run,
        "commands": commands or {},
    }


def describe(summary: dict[str, Any]) -> str:
    """A few lines for the terminal: each client's medians side by side, then the gap."""
    medians = summary["medians"]
    rows = [
        ("output tok/s", "output_tok_s", 1.0, "{:,.0f}"),
        ("requests/s", "served_req_s", 1.0, "{:.2f}"),
        ("TTFT p50 ms", "ttft_p50_s", 1e3, "{:.1f}"),
        ("TTFT p99 ms", "ttft_p99_s", 1e3, "{:.1f}"),
        ("TPOT p50 ms", "tpot_p50_s", 1e3, "{:.2f}"),
        ("ITL p50 ms", "itl_p50_s", 1e3, "{:.2f}"),
        ("prompt tokens", "prompt_tokens_mean", 1.0, "{:.1f}"),
    ]
    lines = [f"{'median of runs':<16}{'bench':>12}{'vllm':>12}{'gap %':>9}"]
    for name, key, scale, fmt in rows:
        cells = []
        for client in CLIENTS:
            value = medians.get(client, {}).get(key)
            cells.append(f"{fmt.format(value * scale):>12}" if value is not None else f"{'-':>12}")
        gap = summary["gap_pct"].get(key)
        lines.append(f"{name:<16}{''.join(cells)}{f'{gap:+.1f}' if gap is not None else '-':>9}")
    agree = summary["agree"]
    verdict = {True: "agree", False: "DIFFER", None: "not compared"}[agree]
    lines.append(f"output tok/s: {verdict} (tolerance {summary['tolerance_pct']:g} %)")
    return "\n".join(lines)

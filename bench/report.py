"""The HTML report: several results side by side, with matplotlib plots inlined as PNG.

`write_report(paths, out)` loads each path with bench.results.load_result and writes one
self-contained page: served vs offered rate, TTFT and latency vs rate, tokens/s vs concurrency,
and tables of the numbers. Results measured in several sampling modes (the perf tier's greedy and
sampled summaries) get a section each, so a figure sets side by side only results of one workload.
The CLI's `report` subcommand and the perf tier call it; `write_plots` writes the same plots as PNG
files (the README's, `report --png PREFIX`).
"""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display: render to PNG only
import matplotlib.pyplot as plt  # noqa: E402

from bench.results import Result, level_key, load_result  # noqa: E402
from bench.trials import describe_prompts, describe_sampling, sampling_settings  # noqa: E402

# (summary key, column header, format): latencies are stored in seconds and shown in milliseconds
OPEN_COLUMNS = [
    ("rate", "offered req/s", "rate"),
    ("served_req_s", "served req/s", "rate"),
    ("output_tok_s", "output tok/s", "tokens"),
    ("goodput_req_s", "goodput req/s", "rate"),
    ("ttft_p50_s", "TTFT p50 ms", "ms"),
    ("ttft_p99_s", "TTFT p99 ms", "ms"),
    ("tpot_p50_s", "TPOT p50 ms", "ms"),
    ("itl_p50_s", "ITL p50 ms", "ms"),
    ("itl_p99_s", "ITL p99 ms", "ms"),
    ("e2e_p50_s", "e2e p50 ms", "ms"),
    ("e2e_p99_s", "e2e p99 ms", "ms"),
    ("send_lag_p99_s", "send lag p99 ms", "ms"),
    ("failures", "failures", "count"),
    ("client_loop_lag_p99_s", "client loop lag p99 ms", "ms"),
    ("client_loop_stall_s", "client loop stall ms", "ms"),
    ("client_cpu_util", "client CPU", "percent"),
]
CLOSED_COLUMNS = [("concurrency", "concurrency", "count")] + [c for c in OPEN_COLUMNS if c[0] != "rate"]
# The offline section (`bench offline`): one row per entry and target; the engine's step phases too.
OFFLINE_COLUMNS = [
    ("served_req_s", "served req/s", "rate"),
    ("output_tok_s", "output tok/s", "tokens"),
    ("ttft_p50_s", "TTFT p50 ms", "ms"),
    ("tpot_p50_s", "TPOT p50 ms", "ms"),
    ("step_ms", "step ms", "plain_ms"),
    ("step_schedule_ms", "schedule ms", "plain_ms"),
    ("step_prepare_ms", "prepare ms", "plain_ms"),
    ("step_execute_ms", "execute ms", "plain_ms"),
    ("step_update_ms", "update ms", "plain_ms"),
    ("step_outputs_ms", "outputs ms", "plain_ms"),
    ("single_tpot_s", "one sequence: ms per token", "ms"),
    ("prefill_tok_s", "prefill prompt tok/s", "tokens"),
    ("failures", "failures", "count"),
]
FORMATS = {
    "rate": lambda v: f"{v:.2f}",
    "tokens": lambda v: f"{v:,.0f}",
    "ms": lambda v: f"{v * 1e3:.1f}",
    "plain_ms": lambda v: f"{v:.2f}",
    "count": lambda v: f"{v:.0f}",
    "percent": lambda v: f"{v:.0%}",
}
STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1200px; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
h3 { font-size: 15px; margin-top: 20px; }
table { border-collapse: collapse; font-size: 12px; margin: 8px 0 16px; }
th, td { border: 1px solid #ddd; padding: 3px 6px; text-align: right; white-space: nowrap; }
th { background: #f3f3f3; white-space: normal; vertical-align: bottom; max-width: 70px; }
td.text, th.text { text-align: left; } .note { font-size: 12px; color: #555; }
summary { cursor: pointer; }
tr.first td { border-top: 2px solid #999; }
img { max-width: 100%; } .warn { color: #a40; } .meta td { text-align: left; white-space: normal; }
pre { font-size: 11px; background: #f7f7f7; padding: 6px; white-space: pre-wrap; margin: 0; }
"""


def write_report(paths: Sequence[str | Path], out: str | Path) -> Path:
    results = [load_result(path) for path in paths]
    _name_targets(results)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(render(results))
    return out


def write_plots(paths: Sequence[str | Path], prefix: str | Path) -> list[Path]:
    """The report's plots as PNG files beside a document that shows them (the README's):
    PREFIX-open-loop.png where a result has open-loop levels, PREFIX-closed-loop.png where one has
    closed-loop levels. Drawn by this code and not by hand, so that a re-stored reference redraws
    them with one command. Results of one workload only (a figure sets side by side only results
    sampled and sent alike): ValueError otherwise, or when no result has a level to draw."""
    results = [load_result(path) for path in paths]
    _name_targets(results)
    modes = list(_by_sampling(results))
    if len(modes) > 1:
        raise ValueError(f"the results differ in workload ({', '.join(modes)}): draw each apart")
    drawn: list[Path] = []
    for mode, plot in (("open", _plot_open), ("closed", _plot_closed)):
        if any(_levels(r, mode) for r in results):
            out = Path(f"{prefix}-{mode}-loop.png")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(plot(results))
            drawn.append(out)
    if not drawn:
        raise ValueError("no open-loop or closed-loop levels in these results: nothing to draw")
    return drawn


def _name_targets(results: list[Result]) -> None:
    """Targets must be distinguishable in legends: fall back to the folder name, then number them.
    Results of different sampling modes never share a figure, so one target's greedy and sampled
    summaries keep its name (the targets table says how each sampled)."""
    for result in results:
        result.target = result.target or Path(result.path).name
    names = [(result.target, _sampling(result)) for result in results]
    for i, result in enumerate(results):
        if names.count((result.target, _sampling(result))) > 1:
            result.target = f"{result.target} ({Path(result.path).name or i + 1})"


def render(results: Sequence[Result]) -> str:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>bench report</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>Benchmark: {', '.join(html.escape(r.target) for r in results)}</h1>",
        _targets_table(results),
    ]
    groups = _by_sampling(results)
    drawn = False
    for label, group in groups.items():
        if len(groups) > 1:
            parts.append(f"<h2>{html.escape(label.capitalize())}</h2>")
        sections = _sections(group, "h3" if len(groups) > 1 else "h2")
        parts += sections
        drawn = drawn or bool(sections)
    if not drawn:
        parts.append("<p>No levels in these results.</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _sampling(result: Result) -> str:
    """How a result sampled and sent its prompts, as the report names it: `greedy`, `sampled
    (temperature 1, top_p 0.95)`, `greedy, text prompts`, `greedy, chat completions`."""
    return describe_sampling(*sampling_settings(result.meta)) + describe_prompts(result.meta)


def _by_sampling(results: Sequence[Result]) -> dict[str, list[Result]]:
    """The results by how they sampled, in the order each mode first appears."""
    groups: dict[str, list[Result]] = {}
    for result in results:
        groups.setdefault(_sampling(result), []).append(result)
    return groups


def _sections(results: Sequence[Result], heading: str) -> list[str]:
    """The open-loop, closed-loop and offline figures and tables of results of one workload."""
    parts = []
    if any(_levels(r, "open") for r in results):
        parts.append(f"<{heading}>Open loop: requests arrive at a rate</{heading}>")
        parts.append(_img(_plot_open(results)))
        parts.append(_levels_table(results, "open", OPEN_COLUMNS))
    if any(_levels(r, "closed") for r in results):
        parts.append(f"<{heading}>Closed loop: a fixed number of requests in flight</{heading}>")
        parts.append(_img(_plot_closed(results)))
        parts.append(_levels_table(results, "closed", CLOSED_COLUMNS))
    if any(r.offline for r in results):
        parts.append(f"<{heading}>Offline: the step-level engine driven in process, no HTTP</{heading}>")
        parts.append(_offline_table(results))
    return parts


def _levels(result: Result, mode: str) -> list[dict[str, Any]]:
    return sorted((lv for lv in result.levels if lv.get("mode") == mode), key=level_key)


def _targets_table(results: Sequence[Result]) -> str:
    rows = []
    for r in results:
        meta = r.meta
        server = meta.get("server") or {}
        body = server.get("body") if isinstance(server, dict) else None
        rtt = meta.get("rtt") or {}
        stream = meta.get("stream_check") or {}
        capacity = "-"
        if r.capacity_req_s is not None:
            capacity = f"{r.capacity_req_s:.2f} req/s" + (
                " (still rising)" if r.capacity_still_rising else ""
            )
        warnings = "".join(f"<div class='warn'>{html.escape(w)}</div>" for w in meta.get("warnings") or [])
        description = (
            body if body is not None else {k: meta[k] for k in ("version", "gpu", "dtype") if k in meta}
        )
        headline = " ".join(
            str(description.get(k)) for k in ("name", "version", "device", "gpu") if isinstance(description, dict)
            and description.get(k)
        )  # fmt: skip
        rows.append(
            "<tr>"
            f"<td class='text'>{html.escape(r.target)}</td>"
            f"<td class='text'>{html.escape(str(meta.get('model', '')))}</td>"
            f"<td class='text'>{html.escape(_sampling(r))}</td>"
            f"<td class='text'><details><summary>{html.escape(headline or 'details')}</summary>"
            f"<pre>{html.escape(json.dumps(description, indent=1)[:3000])}</pre></details></td>"
            f"<td>{_num(rtt.get('rtt_median_s'), 'ms')}</td>"
            f"<td class='text'>{html.escape(str(stream.get('verdict', '-')))}</td>"
            f"<td>{capacity}</td>"
            f"<td class='text'>{html.escape(str(meta.get('started_at', '')))}<br>{html.escape(r.path)}</td>"
            f"<td class='text'>{warnings or '-'}</td></tr>"
        )
    head = "".join(
        f"<th class='text'>{h}</th>"
        for h in ("target", "model", "sampling", "server", "RTT ms", "stream", "capacity", "run", "warnings")
    )
    return f"<table class='meta'><tr>{head}</tr>{''.join(rows)}</table>"


def _levels_table(results: Sequence[Result], mode: str, columns: list[tuple[str, str, str]]) -> str:
    """One row per (level, target), targets of one level adjacent so they read side by side."""
    entries = [(level_key(lv), i, r.target, lv) for i, r in enumerate(results) for lv in _levels(r, mode)]
    entries.sort(key=lambda entry: (entry[0], entry[1]))
    head = "<th class='text'>target</th>" + "".join(f"<th>{label}</th>" for _, label, _ in columns)
    body = []
    previous = None
    for key, _, target, level in entries:
        cls = " class='first'" if key != previous and previous is not None else ""
        previous = key
        cells = "".join(f"<td>{_num(level.get(name), kind)}</td>" for name, _, kind in columns)
        body.append(f"<tr{cls}><td class='text'>{html.escape(target)}</td>{cells}</tr>")
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _offline_table(results: Sequence[Result]) -> str:
    """One row per (offline entry, target), targets of one entry adjacent."""
    keys = list(dict.fromkeys(key for r in results for key in r.offline))
    head = "<th class='text'>mode</th><th class='text'>target</th>" + "".join(
        f"<th>{label}</th>" for _, label, _ in OFFLINE_COLUMNS
    )
    body: list[str] = []
    for key in keys:
        for i, r in enumerate(entry for entry in results if key in entry.offline):
            cls = " class='first'" if i == 0 and body else ""
            cells = "".join(
                f"<td>{_num(r.offline[key].get(name), kind)}</td>" for name, _, kind in OFFLINE_COLUMNS
            )
            body.append(
                f"<tr{cls}><td class='text'>{html.escape(key)}</td><td class='text'>{html.escape(r.target)}</td>{cells}</tr>"
            )
    return f"<table><tr>{head}</tr>{''.join(body)}</table>"


def _num(value: Any, kind: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, bool) or not isinstance(value, int | float):
        return html.escape(str(value))
    return FORMATS[kind](value)


def _img(png: bytes) -> str:
    return f"<img alt='plot' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"


def _series(result: Result, mode: str, x: str, y: str) -> tuple[list[float], list[float]]:
    """(x, y) points of one result's levels; keys in seconds come back in milliseconds."""
    scale = 1e3 if y.endswith("_s") and not y.endswith(("req_s", "tok_s")) else 1.0
    points = [(lv.get(x), None if lv.get(y) is None else lv[y] * scale) for lv in _levels(result, mode)]
    kept = [(float(a), float(b)) for a, b in points if a is not None and b is not None]
    kept = [(a, b) for a, b in kept if not math.isnan(b)]
    return [a for a, _ in kept], [b for _, b in kept]


def _plot_open(results: Sequence[Result]) -> bytes:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    highest = 0.0
    for i, r in enumerate(results):
        color = f"C{i}"
        x, y = _series(r, "open", "rate", "served_req_s")
        highest = max([highest, *x, *y])
        axes[0].plot(x, y, "o-", color=color, label=r.target)
        for ax, name in ((axes[1], "ttft"), (axes[2], "e2e")):
            for stat, style in (("p50", "o-"), ("p99", "s--")):
                x, y = _series(r, "open", "rate", f"{name}_{stat}_s")
                ax.plot(x, y, style, color=color, label=f"{r.target} {stat}")
    axes[0].plot([0, highest], [0, highest], ":", color="gray", label="served = offered")
    axes[0].set(title="Served vs offered rate", xlabel="offered (req/s)", ylabel="served (req/s)")
    axes[1].set(title="TTFT vs rate", xlabel="offered (req/s)", ylabel="ms")
    axes[2].set(title="End-to-end latency vs rate", xlabel="offered (req/s)", ylabel="ms")
    return _finish(fig, axes)


def _plot_closed(results: Sequence[Result]) -> bytes:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for i, r in enumerate(results):
        color = f"C{i}"
        for ax, metric in zip(axes, ("output_tok_s", "ttft_p50_s", "tpot_p50_s"), strict=True):
            x, y = _series(r, "closed", "concurrency", metric)
            ax.plot(x, y, "o-", color=color, label=r.target)
    axes[0].set(title="Output tokens/s vs concurrency", xlabel="concurrency", ylabel="tokens/s")
    axes[1].set(title="TTFT p50 vs concurrency", xlabel="concurrency", ylabel="ms")
    axes[2].set(title="TPOT p50 vs concurrency", xlabel="concurrency", ylabel="ms")
    levels = sorted({float(lv["concurrency"]) for r in results for lv in _levels(r, "closed")})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [f"{x:g}" for x in levels])
        ax.minorticks_off()
    return _finish(fig, axes)


def _finish(fig: Any, axes: Any) -> bytes:
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.set_ylim(0, ax.get_ylim()[1] * 1.08)  # from zero, with room above the highest point
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=90)
    plt.close(fig)
    return buffer.getvalue()

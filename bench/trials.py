"""Repeated trials folded into the perf tier's summary: each figure's median, with its min and max.

The perf tier runs every case `trials` times (pytest-benchmark rounds) and calls `summarize_trials`
once per target at the end. The summary's keys are bench's flat keys, so `bench compare` and
`bench report` read it like a run.json; the `_min`/`_max` columns are what the noise rule reads.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

OPEN_LOOP_KEYS = (
    "served_req_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "tpot_p50_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "failures",
)
CLOSED_LOOP_KEYS = ("output_tok_s", "ttft_p50_s", "itl_p50_s", "tpot_p50_s", "failures")


def spread(values: Sequence[float | None], key: str) -> dict[str, float]:
    """{key: median, key_min: min, key_max: max} over the values that are numbers."""
    numbers = [float(v) for v in values if v is not None and v == v]
    if not numbers:
        return {key: float("nan"), f"{key}_min": float("nan"), f"{key}_max": float("nan")}
    return {key: statistics.median(numbers), f"{key}_min": min(numbers), f"{key}_max": max(numbers)}


def fold_levels(
    trials: Sequence[Iterable[Mapping[str, Any]]], level_key: str, keys: Sequence[str]
) -> list[dict[str, Any]]:
    """Levels of several trials matched by `level_key` (rate or concurrency); a level some trials lack
    (sweep rates found by bisection can differ) is folded over the trials that have it."""
    by_level: dict[float, list[Mapping[str, Any]]] = {}
    for levels in trials:
        for level in levels:
            by_level.setdefault(float(level[level_key]), []).append(level)
    folded = []
    for value in sorted(by_level):
        levels = by_level[value]
        entry: dict[str, Any] = {level_key: value, "trials": len(levels)}
        for key in keys:
            entry.update(spread([level.get(key) for level in levels], key))
        folded.append(entry)
    return folded


def summarize_trials(
    *,
    header: Mapping[str, Any],
    sweep_trials: Sequence[Mapping[str, Any]],
    closed_trials: Sequence[Sequence[Mapping[str, Any]]],
    trials: int,
) -> dict[str, Any]:
    """The summary JSON. sweep_trials: one {"capacity_req_s", "capacity_still_rising", "levels"} per trial;
    closed_trials: for each trial, its closed-loop level summaries."""
    summary: dict[str, Any] = dict(header)
    summary["trials"] = trials
    if sweep_trials:
        summary.update(spread([t["capacity_req_s"] for t in sweep_trials], "capacity_req_s"))
        summary["capacity_still_rising"] = any(t["capacity_still_rising"] for t in sweep_trials)
    else:
        summary["capacity_req_s"] = None
        summary["capacity_still_rising"] = None
    summary["open_loop"] = fold_levels([t["levels"] for t in sweep_trials], "rate", OPEN_LOOP_KEYS)
    summary["closed_loop"] = fold_levels(closed_trials, "concurrency", CLOSED_LOOP_KEYS)
    return summary

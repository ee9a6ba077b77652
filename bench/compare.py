"""Compare two results level by level and flag regressions past a threshold.

`compare_results(base, new, max_drop)` takes anything bench.results.load_result reads (run folders,
run.json, perf-tier summary JSON); which way is better comes from bench.metrics.metric_direction.
The CLI's `compare` prints `Comparison.table()` and exits non-zero when `regressions` is not empty.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.metrics import metric_direction
from bench.results import Result, level_key, load_result

DEFAULT_MAX_DROP: dict[str, float] = {"served_req_s": 5.0, "output_tok_s": 5.0, "ttft_p50_s": 10.0}
SHOWN_METRICS = (
    "served_req_s",
    "output_tok_s",
    "goodput_req_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "tpot_p50_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "failures",
)


def parse_max_drop(text: str) -> dict[str, float]:
    """`"served_req_s=5%,ttft_p50_s=10%"` -> {"served_req_s": 5.0, "ttft_p50_s": 10.0} (percent).

    The % sign is required so that 0.05 cannot be mistaken for 5 %; every key must be a metric with
    a known better direction.
    """
    limits: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        if not value.endswith("%"):
            raise ValueError(f"--max-drop {item!r}: give the allowed change as a percent, e.g. {key}=5%")
        if metric_direction(key) is None:
            raise ValueError(f"--max-drop {item!r}: {key!r} is not a metric with a better direction")
        limits[key] = float(value[:-1])
    return limits


@dataclass(frozen=True)
class ComparisonRow:
    """One metric at one level. `ratio` = new / base. `limit_pct` is the allowed worsening in percent:
    a higher-is-better metric regresses when new < base x (1 − limit/100), a lower-is-better one when
    new > base x (1 + limit/100)."""

    level: str
    metric: str
    base: float
    new: float
    direction: str
    limit_pct: float | None
    regressed: bool

    @property
    def ratio(self) -> float:
        if self.base == 0:
            return math.nan if self.new == 0 else math.inf
        return self.new / self.base


@dataclass
class Comparison:
    base_target: str
    new_target: str
    rows: list[ComparisonRow]
    unmatched: list[str] = field(default_factory=list)  # levels found on one side only

    @property
    def regressions(self) -> list[ComparisonRow]:
        return [row for row in self.rows if row.regressed]

    def table(self) -> str:
        header = (
            "level",
            "metric",
            self.base_target or "base",
            self.new_target or "new",
            "new/base",
            "limit",
            "",
        )
        lines: list[tuple[str, ...]] = [header]
        previous = None
        for row in self.rows:
            if previous is not None and row.level != previous:
                lines.append(("",) * len(header))
            previous = row.level
            limit = (
                ""
                if row.limit_pct is None
                else f"{'-' if row.direction == 'higher' else '+'}{row.limit_pct:g}%"
            )
            verdict = "REGRESSION" if row.regressed else ""
            lines.append(
                (row.level, row.metric, _fmt(row.base), _fmt(row.new), _fmt(row.ratio, 3), limit, verdict)
            )
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in lines
        ]
        text += [f"only on one side: {name}" for name in self.unmatched]
        count = len(self.regressions)
        text.append(
            f"{count} regression{'s' if count != 1 else ''} past the limits" if count else "no regressions"
        )
        return "\n".join(text)


def _fmt(value: float, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return f"{value:.{digits}g}"


def compare_results(
    base: Result | str | Path,
    new: Result | str | Path,
    max_drop: Mapping[str, float] = DEFAULT_MAX_DROP,
) -> Comparison:
    """Match levels by (mode, rate) or (mode, concurrency) and compare every shown or limited metric
    present on both sides; `capacity_req_s` is compared too when both have it. A NaN on either side
    is shown but never a regression."""
    base = base if isinstance(base, Result) else load_result(base)
    new = new if isinstance(new, Result) else load_result(new)
    for metric in max_drop:
        if metric_direction(metric) is None:
            raise ValueError(f"{metric!r} is not a metric with a better direction")
    metrics = list(SHOWN_METRICS) + [key for key in max_drop if key not in SHOWN_METRICS]
    rows: list[ComparisonRow] = []
    if base.capacity_req_s is not None and new.capacity_req_s is not None:
        rows.append(_row("sweep", "capacity_req_s", base.capacity_req_s, new.capacity_req_s, max_drop))
    new_levels = {level_key(level): level for level in new.levels}
    unmatched = []
    for level in sorted(base.levels, key=_level_order):
        level_id = level_key(level)
        other = new_levels.pop(level_id, None)
        if other is None:
            unmatched.append(f"{_level_name(level_id)} ({base.target or 'base'})")
            continue
        for metric in metrics:
            if metric in level and metric in other:
                rows.append(_row(_level_name(level_id), metric, level[metric], other[metric], max_drop))
    unmatched += [f"{_level_name(level_id)} ({new.target or 'new'})" for level_id in new_levels]
    return Comparison(base.target, new.target, rows, unmatched)


def _row(level: str, metric: str, base: Any, new: Any, max_drop: Mapping[str, float]) -> ComparisonRow:
    direction = metric_direction(metric)
    assert direction is not None
    base_value = math.nan if base is None else float(base)
    new_value = math.nan if new is None else float(new)
    limit = max_drop.get(metric)
    regressed = False
    if limit is not None and not (math.isnan(base_value) or math.isnan(new_value)):
        if direction == "higher":
            regressed = new_value < base_value * (1 - limit / 100)
        else:
            regressed = new_value > base_value * (1 + limit / 100)
    return ComparisonRow(level, metric, base_value, new_value, direction, limit, regressed)


def _level_order(level: dict[str, Any]) -> tuple[bool, float]:
    """Open-loop levels first, by rate, then closed-loop ones by concurrency."""
    mode, value = level_key(level)
    return (mode != "open", value)


def _level_name(key: tuple[str, float]) -> str:
    mode, value = key
    return f"rate {value:g}/s" if mode == "open" else f"concurrency {value:g}"

"""Budgets proposed from a lease's figures: what `tests/perf/budgets.toml` could hold after the engine's
and vLLM's summaries of one lease (or references that pool several) were stored.

Each budgeted figure the two summaries share is paired level by level: the ratio of the medians, and
the least favourable pairing of the trials (throughput: the engine's slowest trial against vLLM's
fastest; latency: the engine's slowest against vLLM's quickest), which is what a budget must allow for
when a later run meets the low end of the engine's spread and a reference at the high end of vLLM's.
The proposal keeps `margin` past that pairing (throughput: pairing / margin, rounded down; latency:
pairing x margin, rounded up), since the same vLLM moved up to 28 % between lent hosts. Beside it, the
budget in force and what to do: raise (or tighten) where the proposal is stricter, keep otherwise, and
FAILS where the medians already miss the budget in force.

The file itself is reviewed by hand: a budget is a decision with a reason, written beside it; this
only computes, so that every re-store sets its budgets by one rule.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from bench.budgets import (
    ANY_LEVEL,
    BELOW_SATURATION,
    OFFLINE_BUDGETS,
    Budgets,
    budget_for,
    budget_section,
    level_name,
    match_level,
)
from bench.metrics import known_figure, metric_direction
from bench.trials import case_mode

DEFAULT_MARGIN = 1.3


@dataclass(frozen=True)
class Proposal:
    level: str  # "sweep", "concurrency 32", "rate 4/s", "offline all"
    metric: str  # the budget file's name (offline figures by their `offline_*` name)
    level_key: str  # the key of its per-level table ("32", "4", "all"), or ANY_LEVEL for capacity
    engine: float
    vllm: float
    worst_ratio: float  # the least favourable pairing of the two sides' trials
    current: float | None  # the budget in force, None where the file has none
    proposed: float

    @property
    def higher_is_better(self) -> bool:
        return metric_direction(OFFLINE_BUDGETS.get(self.metric, self.metric)) == "higher"

    @property
    def ratio(self) -> float:
        return self.engine / self.vllm if self.vllm else math.inf

    @property
    def action(self) -> str:
        if self.current is None:
            return f"no budget: add {self.proposed:g}"
        held = self.ratio >= self.current if self.higher_is_better else self.ratio <= self.current
        stricter = self.proposed > self.current if self.higher_is_better else self.proposed < self.current
        if not held:
            return f"FAILS now ({self.ratio:.3f}x vs {self.current:g})"
        if stricter:
            return f"{'raise' if self.higher_is_better else 'tighten'} to {self.proposed:g}"
        return "keep"


def propose_budgets(
    engine: Mapping[str, Any], vllm: Mapping[str, Any], budgets: Mapping[str, Budgets], margin: float
) -> list[Proposal]:
    """A proposal for each budgeted figure at each level both summaries hold (the sweep's capacity,
    TTFT and TPOT p50 at rates below BELOW_SATURATION x the engine's capacity, output tokens/s by
    concurrency, the offline figures), read against the section of the summaries' mode."""
    mode = case_mode(engine)
    if case_mode(vllm) != mode:
        raise ValueError(f"the summaries differ in mode: {mode!r} vs {case_mode(vllm)!r}")
    if margin < 1.0:
        raise ValueError(f"a margin under 1 ({margin}) would propose budgets past the measured ratios")
    section = budgets.get(budget_section("vllm", mode)) or {}
    proposals: list[Proposal] = []

    def add(
        level: str, metric: str, key: str, ours: Mapping[str, Any], theirs: Mapping[str, Any], field: str
    ) -> None:
        higher = metric_direction(field) == "higher"
        worst = _spread(ours, field, low=higher) / _spread(theirs, field, low=not higher)
        scaled = worst / margin if higher else worst * margin
        hundredths = round(scaled * 100, 6)  # 0.57 stays 0.57 (as 56.99999999999999 it would floor to 0.56)
        proposed = (math.floor(hundredths) if higher else math.ceil(hundredths)) / 100
        budget = budget_for(section, metric, key)
        proposals.append(
            Proposal(
                level,
                metric,
                key,
                float(ours[field]),
                float(theirs[field]),
                worst,
                None if budget is None else budget.value,
                proposed,
            )
        )

    capacity = engine.get("capacity_req_s")
    if capacity is not None and vllm.get("capacity_req_s") is not None:
        add("sweep", "capacity_req_s", ANY_LEVEL, engine, vllm, "capacity_req_s")
        theirs_open = list(vllm.get("open_loop") or [])
        for level in engine.get("open_loop") or []:
            rate = float(level["rate"])
            match = match_level(theirs_open, "rate", rate)
            if rate >= BELOW_SATURATION * float(capacity) or match is None:
                continue
            for metric in ("ttft_p50_s", "tpot_p50_s"):
                add(f"rate {rate:g}/s", metric, level_name(rate), level, match, metric)
    theirs_closed = list(vllm.get("closed_loop") or [])
    for level in engine.get("closed_loop") or []:
        match = match_level(theirs_closed, "concurrency", float(level["concurrency"]))
        if match is not None:
            concurrency = float(level["concurrency"])
            add(
                f"concurrency {concurrency:g}",
                "output_tok_s",
                level_name(concurrency),
                level,
                match,
                "output_tok_s",
            )
    theirs_offline = vllm.get("offline") or {}
    for key, entry in (engine.get("offline") or {}).items():
        other = theirs_offline.get(key) or {}
        for name, field in OFFLINE_BUDGETS.items():
            if known_figure(entry.get(field)) and known_figure(other.get(field)):
                add(f"offline {key}", name, key, entry, other, field)
    return proposals


def _spread(entry: Mapping[str, Any], field: str, low: bool) -> float:
    """The low (or high) end of a figure's trials: its `_min` / `_max` where the entry has them (a
    folded summary), else the figure itself (one trial)."""
    end = f"{field}_{'min' if low else 'max'}"
    return float(entry[end]) if known_figure(entry.get(end)) else float(entry[field])


def table(proposals: list[Proposal], margin: float) -> str:
    """The proposals as an aligned text table, and the rule they follow."""
    header = ("level", "budget", "engine", "vLLM", "ratio", "least fav.", "in force", "proposed", "action")
    rows = [
        (
            p.level,
            p.metric,
            f"{p.engine:.4g}",
            f"{p.vllm:.4g}",
            f"{p.ratio:.3f}",
            f"{p.worst_ratio:.3f}",
            "-" if p.current is None else f"{p.current:g}",
            f"{p.proposed:g}",
            p.action,
        )
        for p in proposals
    ]
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=True)]
    lines = [
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in (header, *rows)
    ]
    lines.append(
        f"proposed = least favourable pairing / {margin:g} for throughput (rounded down), x {margin:g} for "
        "latency (rounded up); the file is edited by hand, each budget with its reason"
    )
    return "\n".join(lines)

"""Performance budgets: how the engine's figures must compare with a reference's (vLLM's, or a stored
result of the engine itself), read from one reviewed TOML file.

Throughput budgets (capacity_req_s, closed-loop output_tok_s) ask new >= budget x reference; latency
budgets (ttft_p50_s, tpot_p50_s, open loop below saturation) ask new <= budget x reference; the offline
ones (`offline_*`, OFFLINE_BUDGETS) likewise, by their figure's direction. A lenient budget, under 0.5
for throughput or over 2 for latency, must say why in one line (`reason`).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.metrics import metric_direction

# Offline budgets (`bench offline`): name in the budget file -> the offline figure it holds. Output
# tokens/s is held in every offline mode both sides ran (all at once, closed loops), the others in
# the probes.
OFFLINE_BUDGETS = {
    "offline_output_tok_s": "output_tok_s",
    "offline_single_tpot_s": "single_tpot_s",
    "offline_prefill_tok_s": "prefill_tok_s",
}
BUDGETED_METRICS = ("capacity_req_s", "output_tok_s", "ttft_p50_s", "tpot_p50_s", *OFFLINE_BUDGETS)
BELOW_SATURATION = 0.8  # open-loop latency is budgeted at rates under this fraction of the engine's capacity


@dataclass(frozen=True)
class Budget:
    metric: str
    value: float
    reason: str = ""

    @property
    def lenient(self) -> bool:
        direction = metric_direction(OFFLINE_BUDGETS.get(self.metric, self.metric))
        return self.value < 0.5 if direction == "higher" else self.value > 2.0


@dataclass(frozen=True)
class BudgetCheck:
    level: str  # "sweep", "rate 4/s" or "concurrency 32"
    metric: str
    value: float
    reference: float
    budget: float

    @property
    def ratio(self) -> float:
        return self.value / self.reference if self.reference else math.inf

    @property
    def passed(self) -> bool:
        if math.isnan(self.value) or math.isnan(self.reference):
            return False
        if metric_direction(self.metric) == "higher":
            return self.value >= self.budget * self.reference
        return self.value <= self.budget * self.reference

    def describe(self) -> str:
        sign = ">=" if metric_direction(self.metric) == "higher" else "<="
        verdict = "ok" if self.passed else "FAILS"
        return f"{self.level} {self.metric}: {self.value:.4g} vs reference {self.reference:.4g} = {self.ratio:.3f}x (budget {sign} {self.budget:g}x) {verdict}"


def load_budgets(path: str | Path) -> dict[str, dict[str, Budget]]:
    """{reference target: {metric: Budget}}; refuses unknown metrics and lenient budgets without a reason."""
    raw = tomllib.loads(Path(path).read_text())
    budgets: dict[str, dict[str, Budget]] = {}
    for reference, entries in raw.items():
        budgets[reference] = {}
        for metric, entry in entries.items():
            if metric not in BUDGETED_METRICS:
                raise ValueError(
                    f"{path}: [{reference}] {metric} is not a budgeted metric {BUDGETED_METRICS}"
                )
            value, reason = (
                (entry["budget"], entry.get("reason", "")) if isinstance(entry, dict) else (entry, "")
            )
            budget = Budget(metric, float(value), str(reason).strip())
            if budget.lenient and not budget.reason:
                raise ValueError(
                    f"{path}: [{reference}] {metric} = {budget.value} is lenient and needs a one-line reason"
                )
            budgets[reference][metric] = budget
    return budgets


def _levels(summary: Mapping[str, Any], section: str, key: str) -> dict[float, Mapping[str, Any]]:
    return {float(level[key]): level for level in summary.get(section) or []}


def check_sweep(
    capacity: float,
    open_levels: list[Mapping[str, Any]],
    reference: Mapping[str, Any],
    budgets: Mapping[str, Budget],
) -> list[BudgetCheck]:
    """Capacity, and TTFT/TPOT p50 at every rate both ran below BELOW_SATURATION x the engine's capacity."""
    checks: list[BudgetCheck] = []
    if "capacity_req_s" in budgets and reference.get("capacity_req_s") is not None:
        checks.append(
            BudgetCheck(
                "sweep",
                "capacity_req_s",
                capacity,
                float(reference["capacity_req_s"]),
                budgets["capacity_req_s"].value,
            )
        )
    ref_levels = _levels(reference, "open_loop", "rate")
    for level in open_levels:
        rate = float(level["rate"])
        if rate >= BELOW_SATURATION * capacity or rate not in ref_levels:
            continue
        for metric in ("ttft_p50_s", "tpot_p50_s"):
            if metric in budgets:
                checks.append(
                    BudgetCheck(
                        f"rate {rate:g}/s",
                        metric,
                        float(level[metric]),
                        float(ref_levels[rate][metric]),
                        budgets[metric].value,
                    )
                )
    return checks


def check_closed(
    concurrency: int, level: Mapping[str, Any], reference: Mapping[str, Any], budgets: Mapping[str, Budget]
) -> list[BudgetCheck]:
    ref_level = _levels(reference, "closed_loop", "concurrency").get(float(concurrency))
    if ref_level is None or "output_tok_s" not in budgets:
        return []
    return [
        BudgetCheck(
            f"concurrency {concurrency}",
            "output_tok_s",
            float(level["output_tok_s"]),
            float(ref_level["output_tok_s"]),
            budgets["output_tok_s"].value,
        )
    ]


def check_offline(
    offline: Mapping[str, Mapping[str, Any]], reference: Mapping[str, Any], budgets: Mapping[str, Budget]
) -> list[BudgetCheck]:
    """Each offline budget on every offline entry (`all`, `closed-8`, `probes`) that both the new
    section and the reference's have with that figure."""
    reference_section = reference.get("offline") or {}
    checks = []
    for key, entry in offline.items():
        reference_entry = reference_section.get(key)
        if reference_entry is None:
            continue
        for name, metric in OFFLINE_BUDGETS.items():
            if name in budgets and _number(entry.get(metric)) and _number(reference_entry.get(metric)):
                checks.append(
                    BudgetCheck(
                        f"offline {key}",
                        metric,
                        float(entry[metric]),
                        float(reference_entry[metric]),
                        budgets[name].value,
                    )
                )
    return checks


def _number(value: Any) -> bool:
    return value is not None and not math.isnan(float(value))

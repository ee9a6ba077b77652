"""Performance budgets: how the engine's figures must compare with a reference's (vLLM's, or a stored
result of the engine itself), read from one reviewed TOML file.

Throughput budgets (capacity_req_s, closed-loop output_tok_s) ask new >= budget x reference; latency
budgets (ttft_p50_s, tpot_p50_s, open loop below saturation) ask new <= budget x reference; the offline
ones (`offline_*`, OFFLINE_BUDGETS) likewise, by their figure's direction. A lenient budget, under 0.5
for throughput or over 2 for latency, must say why in one line (`reason`).

Each mode has budgets of its own (bench.trials.CASE_MODES: the sampling modes, and the text and chat
prompt modes): `[vllm]` holds the greedy figures, `[vllm.sampled]` (and its per-level tables,
`[vllm.sampled.output_tok_s]`) the sampled ones, read as the section `vllm.sampled` (`budget_section`),
`[vllm.text]` and `[vllm.chat]` likewise; a mode without its section has nothing to hold its figures
to, and the tier reports each of its checks as skipped, by name.

Which checks are judged here (`judged_here`): against a reference measured on this machine, every one;
against a stored one from another machine, only a vLLM reference's, whose budgets allow for the spread
between hosts. Elsewhere the figures are shown with their ratios (`shown_only`), and only what is
broken on any machine fails: a figure that is not a finite number, or one this run lacks.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.metrics import known_figure, metric_direction
from bench.trials import CASE_MODES, GREEDY

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


ANY_LEVEL = "*"
LEVEL_KEYS = {  # what a per-level budget's keys name, for messages
    "output_tok_s": "concurrency",
    "ttft_p50_s": "rate",
    "tpot_p50_s": "rate",
    "offline_output_tok_s": "offline mode",
    "offline_single_tpot_s": "offline mode",
    "offline_prefill_tok_s": "offline mode",
}
RATE_TOLERANCE = 0.01  # open-loop rates within 1 % of each other are one level (bisection gives floats)
# The references whose budgets are judged whichever machine stored them: a ratio to vLLM on the same GPU
# kind, whose budgets sit 30 % under each measured ratio because the same vLLM figure moved up to 28 %
# between lent hosts (tests/perf/budgets.toml); perf.yml holds every GPU pull request to it. Any other
# stored reference (the engine's own result, which the CPU smoke reads) is judged only on the machine
# that stored it: a time is compared only with a time measured on the same machine.
JUDGED_ON_ANY_MACHINE = frozenset({"vllm"})
SHOWN = "shown (reference from another machine)"


@dataclass(frozen=True)
class Budget:
    metric: str
    value: float
    reason: str = ""
    level: str = ANY_LEVEL  # the level it holds ("8" in flight, rate "2", offline mode "all"), or any

    @property
    def lenient(self) -> bool:
        direction = metric_direction(OFFLINE_BUDGETS.get(self.metric, self.metric))
        return self.value < 0.5 if direction == "higher" else self.value > 2.0


# {metric: {level key or ANY_LEVEL: Budget}} for one reference.
Budgets = Mapping[str, Mapping[str, Budget]]


def level_name(value: float) -> str:
    """A level's key in the budget file: 8 -> "8", 0.5 -> "0.5"."""
    return f"{value:g}"


def budget_for(budgets: Budgets, metric: str, level: str) -> Budget | None:
    """The budget of `metric` at `level`: its own, else the metric's any-level one, else None."""
    entries = budgets.get(metric) or {}
    return entries.get(level) or entries.get(ANY_LEVEL)


@dataclass(frozen=True)
class BudgetCheck:
    level: str  # "sweep", "rate 4/s" or "concurrency 32"
    metric: str
    value: float
    reference: float
    budget: float
    skipped: str = ""  # why this check could not be made (no such level in the reference, no budget)
    missing: str = ""  # what this run lacks that the reference has and a budget holds: fails anywhere
    judged: bool = True  # False: shown with its ratio, not held to the budget (see judged_here)

    @property
    def ratio(self) -> float:
        return self.value / self.reference if self.reference else math.inf

    @property
    def broken(self) -> str:
        """What is wrong with this run's own figure, whichever machine the reference came from: a
        figure it lacks, or one that is not a finite number; "" when nothing is."""
        if self.skipped:
            return ""
        if self.missing:
            return self.missing
        return "" if math.isfinite(self.value) else "not a finite number"

    @property
    def passed(self) -> bool:
        """A made check that holds. A skipped check is not a pass: callers list it, by name."""
        if self.skipped or self.broken or math.isnan(self.reference):
            return False
        if metric_direction(self.metric) == "higher":
            return self.value >= self.budget * self.reference
        return self.value <= self.budget * self.reference

    @property
    def failed(self) -> bool:
        """A broken figure fails on any machine; a missed budget only where the check is judged."""
        if self.skipped:
            return False
        return bool(self.broken) or (self.judged and not self.passed)

    def describe(self) -> str:
        if self.skipped:
            return f"{self.level} {self.metric}: skipped, {self.skipped}"
        sign = ">=" if metric_direction(self.metric) == "higher" else "<="
        budget = f"(budget {sign} {self.budget:g}x)"
        if self.broken:
            return f"{self.level} {self.metric}: {self.broken} {budget} FAILS"
        verdict = ("ok" if self.passed else "FAILS") if self.judged else SHOWN
        return f"{self.level} {self.metric}: {self.value:.4g} vs reference {self.reference:.4g} = {self.ratio:.3f}x {budget} {verdict}"


def judged_here(reference_target: str, same_machine: bool) -> bool:
    """Whether figures held to a reference of `reference_target` are judged by its budgets: always on
    the machine that measured the reference (or in the same run); on another machine only for the
    references in JUDGED_ON_ANY_MACHINE. Otherwise they are shown, not judged (`shown_only`)."""
    return same_machine or reference_target in JUDGED_ON_ANY_MACHINE


def shown_only(checks: list[BudgetCheck]) -> list[BudgetCheck]:
    """The checks with their ratios and budgets kept for the output, none held to its budget; a broken
    figure still fails (`BudgetCheck.failed`)."""
    return [dataclasses.replace(check, judged=False) for check in checks]


def tally(checks: list[BudgetCheck]) -> str:
    """One line: how many checks were judged (and failed), shown only, skipped; and broken figures."""
    judged = [c for c in checks if c.judged and not c.skipped and not c.broken]
    shown = [c for c in checks if not c.judged and not c.skipped and not c.broken]
    broken = [c for c in checks if c.broken]
    failed = sum(1 for c in judged if c.failed)
    parts = [f"{len(judged)} judged ({failed} failed)", f"{len(shown)} {SHOWN}"]
    parts += [f"{len(broken)} broken (failed)"] if broken else []
    parts += [f"{sum(1 for c in checks if c.skipped)} skipped"]
    return "budgets: " + ", ".join(parts)


def skipped(level: str, metric: str, why: str) -> BudgetCheck:
    return BudgetCheck(level, metric, math.nan, math.nan, math.nan, skipped=why)


def budget_section(reference_target: str, mode: str) -> str:
    """The budget file's section for figures of `mode` held to a `reference_target` reference:
    `vllm` for greedy (the sections the file always had), `vllm.sampled` for sampled."""
    return reference_target if mode == GREEDY else f"{reference_target}.{mode}"


def load_budgets(path: str | Path) -> dict[str, dict[str, dict[str, Budget]]]:
    """{section: {metric: {level: Budget}}}, a section being a reference target (`vllm`, greedy
    figures) or a reference target and a sampling mode (`vllm.sampled`, from `[vllm.sampled]`). A
    metric's entry is one budget for every level (a number or `{ budget, reason }`, stored under
    ANY_LEVEL) or a table of them by level (`[vllm.output_tok_s]` with `1 = ...`, `8 = ...`). Refuses
    unknown metrics and lenient budgets without a reason."""
    raw = tomllib.loads(Path(path).read_text())
    sections: dict[str, dict[str, Any]] = {}
    for reference, entries in raw.items():
        sections[reference] = {key: entry for key, entry in entries.items() if key not in CASE_MODES}
        if GREEDY in entries:
            raise ValueError(
                f"{path}: [{reference}] holds the greedy budgets itself: no [{reference}.{GREEDY}]"
            )
        for mode in CASE_MODES:
            if mode in entries:
                sections[budget_section(reference, mode)] = entries[mode]
    budgets: dict[str, dict[str, dict[str, Budget]]] = {}
    for reference, entries in sections.items():
        budgets[reference] = {}
        for metric, entry in entries.items():
            if metric not in BUDGETED_METRICS:
                raise ValueError(
                    f"{path}: [{reference}] {metric} is not a budgeted metric {BUDGETED_METRICS}"
                )
            per_level = isinstance(entry, dict) and "budget" not in entry
            levels = entry if per_level else {ANY_LEVEL: entry}
            budgets[reference][metric] = {}
            for level, item in levels.items():
                if per_level and LEVEL_KEYS.get(metric) in ("rate", "concurrency"):
                    try:
                        float(level)
                    except ValueError:
                        raise ValueError(
                            f"{path}: [{reference}.{metric}] {level!r} is not a {LEVEL_KEYS[metric]} (a plain "
                            "key after a [table] header lands in that table: put plain keys first)"
                        ) from None
                value, reason = (
                    (item["budget"], item.get("reason", "")) if isinstance(item, dict) else (item, "")
                )
                budget = Budget(metric, float(value), str(reason).strip(), str(level))
                where = f"[{reference}] {metric}" + ("" if level == ANY_LEVEL else f" at {level}")
                if budget.lenient and not budget.reason:
                    raise ValueError(
                        f"{path}: {where} = {budget.value} is lenient and needs a one-line reason"
                    )
                budgets[reference][metric][str(level)] = budget
    return budgets


def match_level(levels: list[Mapping[str, Any]], key: str, value: float) -> Mapping[str, Any] | None:
    """The level whose `key` is `value` (rates within RATE_TOLERANCE), or None."""
    for level in levels:
        other = float(level[key])
        if other == value or (key == "rate" and math.isclose(other, value, rel_tol=RATE_TOLERANCE)):
            return level
    return None


def check_sweep(
    capacity: float,
    open_levels: list[Mapping[str, Any]],
    reference: Mapping[str, Any],
    budgets: Budgets,
) -> list[BudgetCheck]:
    """Capacity, and TTFT/TPOT p50 at every rate below BELOW_SATURATION x the engine's capacity, each
    with its rate's budget; a rate the reference lacks, or that has no budget, is a skipped check."""
    checks: list[BudgetCheck] = []
    if (budget := budget_for(budgets, "capacity_req_s", ANY_LEVEL)) is not None:
        if reference.get("capacity_req_s") is None:
            checks.append(skipped("sweep", "capacity_req_s", "the reference has no capacity"))
        else:
            checks.append(
                BudgetCheck(
                    "sweep", "capacity_req_s", capacity, float(reference["capacity_req_s"]), budget.value
                )
            )
    ref_levels = list(reference.get("open_loop") or [])
    for level in open_levels:
        rate = float(level["rate"])
        if rate >= BELOW_SATURATION * capacity:
            continue
        name = f"rate {rate:g}/s"
        ref_level = match_level(ref_levels, "rate", rate)
        for metric in ("ttft_p50_s", "tpot_p50_s"):
            if metric not in budgets:
                continue
            budget = budget_for(budgets, metric, level_name(rate))
            if budget is None:
                checks.append(skipped(name, metric, f"no budget for rate {rate:g} in the budget file"))
            elif ref_level is None:
                checks.append(skipped(name, metric, f"the reference has no rate {rate:g}/s"))
            else:
                checks.append(
                    BudgetCheck(name, metric, float(level[metric]), float(ref_level[metric]), budget.value)
                )
    return checks


def check_closed(
    concurrency: int, level: Mapping[str, Any], reference: Mapping[str, Any], budgets: Budgets
) -> list[BudgetCheck]:
    """output_tok_s at this concurrency against its own budget; a skipped check, by name, when the
    reference lacks the level or the file has no budget for it."""
    if "output_tok_s" not in budgets:
        return []
    name = f"concurrency {concurrency}"
    budget = budget_for(budgets, "output_tok_s", level_name(concurrency))
    if budget is None:
        return [skipped(name, "output_tok_s", f"no budget for concurrency {concurrency} in the budget file")]
    ref_level = match_level(list(reference.get("closed_loop") or []), "concurrency", float(concurrency))
    if ref_level is None:
        return [skipped(name, "output_tok_s", f"the reference has no concurrency {concurrency}")]
    return [
        BudgetCheck(
            name, "output_tok_s", float(level["output_tok_s"]), float(ref_level["output_tok_s"]), budget.value
        )
    ]


def check_offline(
    offline: Mapping[str, Mapping[str, Any]], reference: Mapping[str, Any], budgets: Budgets
) -> list[BudgetCheck]:
    """Each offline budget on every offline entry (`all`, `closed-8`, `probes`) of this run or the
    reference that has its figure, with the entry's own budget (else the any-mode one); skipped, by
    name, where the reference lacks the entry or figure, or the file has no budget for that mode; a
    failing check (`missing`) where this run lacks a budgeted figure that the reference has."""
    reference_section = reference.get("offline") or {}
    checks = []
    for key in dict.fromkeys([*offline, *reference_section]):
        entry, reference_entry = offline.get(key) or {}, reference_section.get(key) or {}
        level = f"offline {key}"
        for name, metric in OFFLINE_BUDGETS.items():
            ours, theirs = entry.get(metric), reference_entry.get(metric)
            if ours is None and not known_figure(theirs):
                continue
            budget = budget_for(budgets, name, key) if name in budgets else None
            if budget is None:
                if ours is not None:
                    checks.append(skipped(level, metric, f"no {name} budget for offline mode {key!r}"))
            elif not known_figure(theirs):
                checks.append(skipped(level, metric, f"the reference has no offline {key} {metric}"))
            elif ours is None:
                why = f"this run has no offline {key} {metric}"
                held = float(reference_entry[metric])
                checks.append(BudgetCheck(level, metric, math.nan, held, budget.value, missing=why))
            else:
                held = float(reference_entry[metric])
                checks.append(BudgetCheck(level, metric, float(entry[metric]), held, budget.value))
    return checks


def may_store_baseline(checks: list[BudgetCheck], failed_cases: int, force: bool) -> str | None:
    """None when a run may be stored as a baseline, else why not: a run whose budgets failed, or whose
    cases failed (failed requests), would become the reference the next runs are held to."""
    if force:
        return None
    failed = [check.describe() for check in checks if check.failed]
    if failed or failed_cases:
        what = f"{len(failed)} budget check(s) failed" if failed else f"{failed_cases} case(s) failed"
        return f"not stored: {what}; fix it, or store anyway with --force"
    return None

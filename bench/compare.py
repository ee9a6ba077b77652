"""Compare two results level by level and flag regressions past a limit and past the base's own noise.

`compare_results(base, new, max_drop)` takes anything bench.results.load_result reads (run folders,
run.json, perf-tier summary JSON with `<key>_min`/`<key>_max` beside each median); which way is
better comes from bench.metrics.metric_direction; `decide` is the rule for one row (see its
docstring: the new run's spread can never excuse it). The CLI's `compare` and `ab` print
`Comparison.table()` or `Comparison.markdown()` and exit with `Comparison.exit_status()`. Results
measured in different sampling modes (greedy against sampled) are compared with a note saying so;
`combine` puts comparisons of several modes (bench ab's) into one.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scipy import stats

from bench.metrics import STEP_TIMING, known_figure, metric_direction
from bench.results import Result, level_key, load_result
from bench.trials import GREEDY, describe_prompts, describe_sampling, sampling_settings

# The regression gate's limits (the engine against itself): throughput 5 %, latency p50 10 %, no new
# failures; offline, the same figures per mode, the probes, and step_ms (only where both sides took
# the same number of steps, see _limit).
DEFAULT_MAX_DROP: dict[str, float] = {
    "capacity_req_s": 5.0,
    "served_req_s": 5.0,
    "output_tok_s": 5.0,
    "ttft_p50_s": 10.0,
    "tpot_p50_s": 10.0,
    "itl_p50_s": 10.0,
    "failures": 0.0,
    "prefill_tok_s": 5.0,
    "single_ttft_s": 10.0,
    "single_tpot_s": 10.0,
    "step_ms": 10.0,
}
# Exit status of `bench compare` / `bench ab`.
EXIT_OK, EXIT_REGRESSION, EXIT_BAD_INPUT, EXIT_NOTHING_COMPARED, EXIT_UNRELIABLE = 0, 1, 2, 3, 4
# Open-loop rates within this fraction of each other are one level (a sweep's bisection rates are floats).
RATE_TOLERANCE = 0.01
# Latency and failures at open-loop rates at or past this fraction of the base's capacity are shown, not
# limited: there a level's latency is its queue, and 429/503 past saturation is load shedding.
BELOW_SATURATION = 0.8
REGRESSION, UNRELIABLE, OK = "REGRESSION", "UNRELIABLE", "ok"
# `decide`'s tests on the trials: how sure a drop past its limit must be before it is a regression, and
# how much more than the base's the new trials may scatter before the new run counts as noisy.
SEPARATION_ALPHA = 0.05
NOISIER_ALPHA = 0.01
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
    "prefix_cache_hit_rate",  # where both sides' levels have one (the prefix-cache modes)
)
# The offline section (`bench offline`): these, then the engine's step phases (`step_<phase>_ms`).
OFFLINE_SHOWN_METRICS = (
    "served_req_s",
    "output_tok_s",
    "ttft_p50_s",
    "tpot_p50_s",
    "itl_p50_s",
    "failures",
    "step_ms",
    "single_ttft_s",
    "single_tpot_s",
    "prefill_tok_s",
    "prefix_cache_hit_rate",  # where both sides' caches looked prompts up (bench offline's counters)
)
# meta["machine"] fields that make two measurements come from different machines, in the order the
# note names them.
MACHINE_FIELDS = ("hostname", "gpu", "cpu_model", "cpu_count")


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
class Figure:
    """One side of a row: the median over trials and, when trials were run, their min and max, and
    each trial's value where they are known (`samples`; see `_figure`)."""

    value: float
    low: float | None = None
    high: float | None = None
    samples: tuple[float, ...] | None = None

    def worse_spread_pct(self, direction: str) -> float:
        """How far the worst trial strays from the median on the worse side, in percent of the median
        (higher-is-better: (median − min) / median; lower-is-better: (max − median) / median); 0 for a
        single run."""
        if self.low is None or self.high is None or self.value == 0:
            return 0.0
        worst = self.low if direction == "higher" else self.high
        return max(0.0, _worsening_pct(self.value, worst, direction))

    def text(self) -> str:
        if self.low is None or self.high is None or self.low == self.high:
            return _fmt(self.value)
        return f"{_fmt(self.value)} [{_fmt(self.low)}, {_fmt(self.high)}]"


def separated(base: Sequence[float], new: Sequence[float], direction: str) -> bool | None:
    """Are new's trials worse than base's beyond the trials' own scatter? A one-sided two-sample t-test
    with the variance pooled from both sides' trials, at SEPARATION_ALPHA. Trials are the unit: a
    server started afresh lands a few percent apart from the last one, more than the requests inside
    one trial scatter. None when it cannot be computed (fewer than three trials in all)."""
    n_base, n_new = len(base), len(new)
    if n_base + n_new < 3 or min(n_base, n_new) < 1:
        return None
    mean_base, mean_new = statistics.fmean(base), statistics.fmean(new)
    worse = (mean_base - mean_new) if direction == "higher" else (mean_new - mean_base)
    squares = sum((x - mean_base) ** 2 for x in base) + sum((x - mean_new) ** 2 for x in new)
    dof = n_base + n_new - 2
    scale = math.sqrt(squares / dof * (1 / n_base + 1 / n_new))
    if scale == 0:
        return worse > 0
    return bool(stats.t.sf(worse / scale, dof) < SEPARATION_ALPHA)


def noisier(base: Sequence[float], new: Sequence[float]) -> bool | None:
    """Do new's trials scatter significantly more than base's? A one-sided F-test of their variances
    at NOISIER_ALPHA. None when either side has fewer than two trials."""
    if len(base) < 2 or len(new) < 2:
        return None
    var_base, var_new = statistics.variance(base), statistics.variance(new)
    if var_new == 0:
        return False
    if var_base == 0:
        return True
    return bool(stats.f.sf(var_new / var_base, len(new) - 1, len(base) - 1) < NOISIER_ALPHA)


def decide(base: Figure, new: Figure, direction: str, limit_pct: float | None) -> str:
    """The verdict of one row: REGRESSION, UNRELIABLE, OK, or "" when the row has no limit.

    worsening = how much worse new's median is than base's, in percent of base's (a drop for
    higher-is-better, a rise for lower-is-better); band = the base's own noise, how far its worst trial
    strays from its median on the worse side (`Figure.worse_spread_pct`; 0 for one trial).

    - REGRESSION: worsening > limit and worsening > band, and the trials say it is no accident: new's
      trials are worse than base's beyond the scatter of both (`separated`), or new's trials scatter
      significantly more than base's (`noisier`: a change that makes the figure unstable and its
      median worse is a regression, and its scatter can never excuse it: new trials [900, 600, 610]
      against base [900, 899, 901] are a 32 % drop). Where trial values are not known (one trial, or
      only a median, min and max of more than three), past the limit and the band is enough.
    - UNRELIABLE (rerun, more trials: `bench ab --max-trials`): past the limit but inside the base's
      band, or past both but with trials that overlap too much to tell (an A/A of one commit on the
      H200 landed up to 32 % apart on latency medians with two trials a side); or new's median is
      fine but new's trials scatter significantly more than base's and its worst trial is worse than
      base's median by more than both the limit and the band (a noisy new run is not a pass).
    - OK otherwise. A NaN on either side is never a regression (shown, not decided).
    """
    if limit_pct is None:
        return ""
    if math.isnan(base.value) or math.isnan(new.value):
        return OK
    worsening = _worsening_pct(base.value, new.value, direction)
    band = base.worse_spread_pct(direction)
    base_trials, new_trials = base.samples, new.samples
    if worsening > limit_pct:
        if worsening <= band:
            return UNRELIABLE
        if base_trials is None or new_trials is None:
            return REGRESSION
        if separated(base_trials, new_trials, direction) is not False or noisier(base_trials, new_trials):
            return REGRESSION
        return UNRELIABLE
    worst = new.low if direction == "higher" else new.high
    if worst is not None and _worsening_pct(base.value, worst, direction) > max(limit_pct, band):
        if base_trials is None or new_trials is None:
            return UNRELIABLE
        return UNRELIABLE if noisier(base_trials, new_trials) is not False else OK
    return OK


@dataclass(frozen=True)
class ComparisonRow:
    """One metric at one level. `ratio` = new / base. `limit_pct` is the allowed worsening in percent
    (None: shown, not decided); `noise_pct` is the base's band (see `decide`, which sets `verdict`)."""

    level: str
    metric: str
    base: float
    new: float
    direction: str
    limit_pct: float | None
    verdict: str
    base_low: float | None = None
    base_high: float | None = None
    new_low: float | None = None
    new_high: float | None = None

    @property
    def ratio(self) -> float:
        if self.base == 0:
            return math.nan if self.new == 0 else math.inf
        return self.new / self.base

    @property
    def regressed(self) -> bool:
        return self.verdict == REGRESSION

    @property
    def unreliable(self) -> bool:
        return self.verdict == UNRELIABLE

    @property
    def noise_pct(self) -> float:
        return Figure(self.base, self.base_low, self.base_high).worse_spread_pct(self.direction)

    def cells(self) -> tuple[str, ...]:
        limit = (
            ""
            if self.limit_pct is None
            else f"{'-' if self.direction == 'higher' else '+'}{self.limit_pct:g}%"
        )
        noise = f"{self.noise_pct:.1f}%" if self.noise_pct > 0 else ""
        verdict = {REGRESSION: "REGRESSION", UNRELIABLE: "UNRELIABLE, rerun"}.get(self.verdict, "")
        return (
            self.level,
            self.metric,
            Figure(self.base, self.base_low, self.base_high).text(),
            Figure(self.new, self.new_low, self.new_high).text(),
            _fmt(self.ratio, 3),
            limit,
            noise,
            verdict,
        )


@dataclass
class Comparison:
    base_target: str
    new_target: str
    rows: list[ComparisonRow]
    unmatched: list[str] = field(default_factory=list)  # levels found on one side only
    machine_note: str | None = None  # set when base and new were measured on different machines
    sampling_note: str | None = None  # set when base and new sampled differently (greedy vs sampled)

    @property
    def notes(self) -> list[str]:
        return [note for note in (self.sampling_note, self.machine_note) if note]

    @property
    def regressions(self) -> list[ComparisonRow]:
        return [row for row in self.rows if row.regressed]

    @property
    def unreliable(self) -> list[ComparisonRow]:
        return [row for row in self.rows if row.unreliable]

    @property
    def decided(self) -> list[ComparisonRow]:
        """Rows with a limit, compared on both sides (NaN rows included: they were there to compare)."""
        return [row for row in self.rows if row.verdict]

    def header(self) -> tuple[str, ...]:
        base, new = self.base_target or "base", self.new_target or "new"
        if base == new:
            base, new = f"{base} (base)", f"{new} (new)"
        return ("level", "metric", base, new, "new/base", "limit", "base noise", "verdict")

    def exit_status(self) -> int:
        """1 on a regression, else 4 when a row is unreliable (rerun), else 3 when no row with a limit
        was compared on both sides (nothing was checked), else 0."""
        if self.regressions:
            return EXIT_REGRESSION
        if self.unreliable:
            return EXIT_UNRELIABLE
        if not self.decided:
            return EXIT_NOTHING_COMPARED
        return EXIT_OK

    def verdict(self) -> str:
        count = len(self.regressions)
        if count:
            text = f"{count} regression{'s' if count != 1 else ''} past the limits and the base's noise"
        elif not self.decided:
            return "nothing compared: no figure with a limit on both sides"
        else:
            text = "no regressions"
        if self.unreliable:
            text += (
                f"; {len(self.unreliable)} unreliable (past a limit, but inside the base's noise or with "
                "trials too few to tell, or a noisy new run): rerun with more trials "
                "(`bench ab --max-trials`)"
            )
        return text

    def table(self) -> str:
        header = self.header()
        lines: list[tuple[str, ...]] = [header]
        previous = None
        for row in self.rows:
            if previous is not None and row.level != previous:
                lines.append(("",) * len(header))
            previous = row.level
            lines.append(row.cells())
        widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
        text = [
            "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
            for line in lines
        ]
        text += [f"only on one side: {name}" for name in self.unmatched]
        text += self.notes
        text.append(self.verdict())
        return "\n".join(text)

    def markdown(self) -> str:
        """A GitHub-flavoured table for a job summary: verdict, machine note, table, unmatched levels."""
        mark = "✅" if self.exit_status() == EXIT_OK else "❌"
        text = [f"### bench compare: {self.base_target or 'base'} → {self.new_target or 'new'}", ""]
        text += [f"{mark} **{self.verdict()}**", ""]
        for note in self.notes:
            text += [f"> {note}", ""]
        header = self.header()
        text.append("| " + " | ".join(_md(cell) for cell in header) + " |")
        text.append("|" + "|".join(["---", "---", "---:", "---:", "---:", "---:", "---:", "---"]) + "|")
        for row in self.rows:
            cells = list(row.cells())
            if cells[-1]:
                cells[-1] = f"**{cells[-1]}**"
            text.append("| " + " | ".join(_md(cell) for cell in cells) + " |")
        if self.unmatched:
            text += ["", *[f"- only on one side: {_md(name)}" for name in self.unmatched]]
        return "\n".join(text) + "\n"


def _md(cell: str) -> str:
    return cell.replace("|", "\\|")


def _fmt(value: float | None, digits: int = 4) -> str:
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
    """Match levels by concurrency (closed loop) or by rate within RATE_TOLERANCE (open loop) and
    compare every shown or limited metric present on both sides; `capacity_req_s` too when both have
    it, and the offline section's entries by their key (`offline all`, `offline closed-8`, `offline
    probes`). Which rows are limited: see `_limit`. A NaN on either side is shown, never decided."""
    base = base if isinstance(base, Result) else load_result(base)
    new = new if isinstance(new, Result) else load_result(new)
    for metric in max_drop:
        if metric_direction(metric) is None:
            raise ValueError(f"{metric!r} is not a metric with a better direction")
    metrics = list(SHOWN_METRICS) + [key for key in max_drop if key not in SHOWN_METRICS]
    rows: list[ComparisonRow] = []
    if base.capacity_req_s is not None and new.capacity_req_s is not None:
        base_figure = _figure({**base.meta, "capacity_req_s": base.capacity_req_s}, "capacity_req_s", base)
        new_figure = _figure({**new.meta, "capacity_req_s": new.capacity_req_s}, "capacity_req_s", new)
        rows.append(_row("sweep", "capacity_req_s", base_figure, new_figure, max_drop.get("capacity_req_s")))
    new_levels = list(new.levels)
    unmatched = []
    for level in sorted(base.levels, key=_level_order):
        level_id = level_key(level)
        other = _take_match(level_id, new_levels)
        if other is None:
            unmatched.append(f"{_level_name(level_id)} ({base.target or 'base'})")
            continue
        saturated = (
            level_id[0] == "open"
            and base.capacity_req_s is not None
            and level_id[1] >= BELOW_SATURATION * float(base.capacity_req_s)
        )
        for metric in metrics:
            if metric in level and metric in other:
                limit = _limit(metric, max_drop, saturated=saturated)
                rows.append(
                    _row(
                        _level_name(level_id),
                        metric,
                        _figure(level, metric, base),
                        _figure(other, metric, new),
                        limit,
                    )
                )
    unmatched += [f"{_level_name(level_key(level))} ({new.target or 'new'})" for level in new_levels]
    for key, entry in base.offline.items():
        name = f"offline {key}"
        other = new.offline.get(key)
        if other is None:
            unmatched.append(f"{name} ({base.target or 'base'})")
            continue
        same_steps = entry.get("steps") == other.get("steps")
        for metric in _offline_metrics(entry, max_drop):
            if metric in other:
                limit = _limit(metric, max_drop, same_steps=same_steps)
                rows.append(
                    _row(name, metric, _figure(entry, metric, base), _figure(other, metric, new), limit)
                )
    unmatched += [f"offline {key} ({new.target or 'new'})" for key in new.offline if key not in base.offline]
    return Comparison(
        base.target, new.target, rows, unmatched, machine_note(base, new), sampling_note(base, new)
    )


def combine(comparisons: Mapping[str, Comparison]) -> Comparison:
    """Comparisons of one pair in several sampling modes (bench ab's greedy and sampled) as one: the
    greedy rows as they are, another mode's levels named `sampled: concurrency 8`, so one verdict and
    one exit status cover every mode (a regression or an unreliable row in any of them counts)."""
    if not comparisons:
        raise ValueError("nothing to combine")

    def name(mode: str, level: str) -> str:
        return level if mode == GREEDY else f"{mode}: {level}"

    first = next(iter(comparisons.values()))
    rows = [
        dataclasses.replace(row, level=name(mode, row.level))
        for mode, comparison in comparisons.items()
        for row in comparison.rows
    ]
    unmatched = [
        name(mode, level) for mode, comparison in comparisons.items() for level in comparison.unmatched
    ]
    notes = [c.machine_note for c in comparisons.values() if c.machine_note]
    sampling = [c.sampling_note for c in comparisons.values() if c.sampling_note]
    return Comparison(
        first.base_target,
        first.new_target,
        rows,
        unmatched,
        notes[0] if notes else None,
        "; ".join(sampling) if sampling else None,
    )


def sampling_note(base: Result, new: Result) -> str | None:
    """A line saying the two results sampled or sent their prompts differently (greedy against sampled,
    token ids against text or chat: two workloads, so a ratio there is not a regression), or None when
    they were alike."""
    base_sampling, new_sampling = sampling_settings(base.meta), sampling_settings(new.meta)
    base_prompts, new_prompts = describe_prompts(base.meta), describe_prompts(new.meta)
    if base_sampling == new_sampling and base_prompts == new_prompts:
        return None
    base_mode = describe_sampling(*base_sampling) + base_prompts
    new_mode = describe_sampling(*new_sampling) + new_prompts
    return (
        f"note: base is {base_mode}, new is {new_mode}: "
        "different workloads, so ratios compare sampling or prompt modes, not versions"
    )


def _limit(
    metric: str, max_drop: Mapping[str, float], saturated: bool = False, same_steps: bool = True
) -> float | None:
    """The metric's limit, except: latency and failures at an open-loop rate at or past
    BELOW_SATURATION x the base's capacity (a queue, and load shedding, not a regression); step_ms
    when the two sides took a different number of steps (a scheduler that makes fewer, larger steps
    raises step_ms and is judged by its tokens/s)."""
    if saturated and metric_direction(metric) == "lower":
        return None
    if metric == "step_ms" and not same_steps:
        return None
    return max_drop.get(metric)


def _take_match(level_id: tuple[str, float], candidates: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Remove and return the level of `candidates` that is `level_id`: the same concurrency, or a rate
    within RATE_TOLERANCE (relative)."""
    mode, value = level_id
    for i, level in enumerate(candidates):
        other_mode, other = level_key(level)
        if other_mode != mode:
            continue
        if other == value or (mode == "open" and math.isclose(other, value, rel_tol=RATE_TOLERANCE)):
            return candidates.pop(i)
    return None


def _offline_metrics(entry: Mapping[str, Any], max_drop: Mapping[str, float]) -> list[str]:
    """The shown offline metrics an entry has, its step phases after `step_ms`, then limited ones."""
    shown = [metric for metric in OFFLINE_SHOWN_METRICS if metric in entry]
    phases = [key for key in entry if key not in shown and STEP_TIMING.match(key) and metric_direction(key)]
    position = shown.index("step_ms") + 1 if "step_ms" in shown else len(shown)
    metrics = shown[:position] + phases + shown[position:]
    return metrics + [key for key in max_drop if key in entry and key not in metrics]


def _figure(figures: Mapping[str, Any], metric: str, result: Result) -> Figure:
    """The median `figures[metric]` with its `_min`/`_max`, unless the level (or else the result) says
    it was a single trial; and each trial's value: `<metric>_trials` where the summary lists them
    (bench.trials writes them), else read back from the median, min and max of two or three trials."""
    value = math.nan if figures.get(metric) is None else float(figures[metric])
    low, high = _number(figures.get(f"{metric}_min")), _number(figures.get(f"{metric}_max"))
    trials = figures.get("trials", result.meta.get("trials"))
    if trials == 1 or low is None or high is None:
        return Figure(value)
    listed = figures.get(f"{metric}_trials")
    samples: tuple[float, ...] | None = None
    if isinstance(listed, list) and len(listed) >= 2:
        numbers = [_number(x) for x in listed]
        samples = tuple(x for x in numbers if x is not None) if None not in numbers else None
    elif trials == 2:
        samples = (low, high)
    elif trials == 3 and not math.isnan(value):
        samples = (low, value, high)
    return Figure(value, low, high, samples)


def _number(value: Any) -> float | None:
    """A float, or None for a missing or NaN value."""
    return float(value) if known_figure(value) else None


def _row(level: str, metric: str, base: Figure, new: Figure, limit: float | None) -> ComparisonRow:
    direction = metric_direction(metric)
    assert direction is not None
    return ComparisonRow(
        level,
        metric,
        base.value,
        new.value,
        direction,
        limit,
        decide(base, new, direction, limit),
        base.low,
        base.high,
        new.low,
        new.high,
    )


def _worsening_pct(base: float, new: float, direction: str) -> float:
    """How much worse new is than base, in percent of base (negative when better)."""
    change = (base - new) if direction == "higher" else (new - base)
    if base == 0:
        return math.inf if change > 0 else -math.inf if change < 0 else 0.0
    return change / abs(base) * 100


def machine_note(base: Result, new: Result) -> str | None:
    """A line saying the two results were measured on different machines, or None when the fields
    both sides record (hostname, gpu, cpu_model, cpu_count of meta["machine"]) agree."""
    base_machine, new_machine = base.meta.get("machine"), new.meta.get("machine")
    if not isinstance(base_machine, dict) or not isinstance(new_machine, dict):
        return None
    shared = [
        key
        for key in MACHINE_FIELDS
        if base_machine.get(key) not in (None, "") and new_machine.get(key) not in (None, "")
    ]
    if all(str(base_machine[key]) == str(new_machine[key]) for key in shared):
        return None

    def describe(machine: dict[str, Any]) -> str:
        parts = [str(machine[key]) for key in shared if key != "cpu_count"]
        if "cpu_count" in shared:
            parts.append(f"{machine['cpu_count']} cpus")
        return "/".join(parts)

    return (
        f"note: base measured on {describe(base_machine)}, new on {describe(new_machine)}: machines "
        "differ, so ratios are a reference, not a same-machine measurement"
    )


def _level_order(level: dict[str, Any]) -> tuple[bool, float]:
    """Open-loop levels first, by rate, then closed-loop ones by concurrency."""
    mode, value = level_key(level)
    return (mode != "open", value)


def _level_name(key: tuple[str, float]) -> str:
    mode, value = key
    return f"rate {value:g}/s" if mode == "open" else f"concurrency {value:g}"

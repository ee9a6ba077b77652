"""Repeated trials folded into the perf tier's summary: each figure's median, with its min and max.

The perf tier runs every case `trials` times (pytest-benchmark rounds) and calls `summarize_trials`
once per target and sampling mode at the end. The summary's keys are bench's flat keys, so `bench
compare` and `bench report` read it like a run.json; the `_min`/`_max` columns are what the noise rule
reads. The sampling modes (greedy, sampled) and their summaries' file names live here too, for the
tier, `bench ab`, `bench merge`, the report and `bench compare` alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from bench.metrics import STEP_TIMING, known_figure
from bench.server_metrics import FIRST_TOKEN_KEYS, KERNEL_COMPILES_KEY
from bench.workload import SAMPLED

if TYPE_CHECKING:
    from bench.runner import SweepResult

# The sampling modes the seed-mix workload is measured in, each as WorkloadSpec's temperature and top_p:
# greedy, as every stored baseline before them was measured, and sampled, what a typical chat client
# sends (the OpenAI API's default temperature; bench.workload.SAMPLED). Greedy runs first.
GREEDY = "greedy"
SAMPLING_MODES: dict[str, dict[str, float]] = {
    GREEDY: {"temperature": 0.0, "top_p": 1.0},
    "sampled": dict(SAMPLED),
}
# The perf tier's modes that send the seed-mix another way, greedy: as text prompts of the same token
# lengths (the server's tokenizer on the request path), and through the chat completions API (its chat
# template too), each as WorkloadSpec's prompt_format and api. `bench ab` measures the sampling modes
# only; these are the tier's (bench.profiles.Profile.prompt_modes).
PROMPT_MODES: dict[str, dict[str, str]] = {
    "text": {"prompt_format": "text", "api": "completions"},
    "chat": {"prompt_format": "text", "api": "chat"},
}
# The perf tier's prefix-cache modes: both servers with their prefix cache on (each's default), every
# level from an empty cache with prompts of its own (bench.prefix.run_fresh_level), greedy token ids.
# `workload` is WorkloadSpec.kind: requests sharing one of K prefixes, a multi-turn replay, and the
# seed-mix, whose requests share nothing (what the cache costs where it never hits).
PREFIX_MODES: dict[str, dict[str, str]] = {
    "shared-prefix": {"workload": "shared-prefix"},
    "multi-turn": {"workload": "multi-turn"},
    "cache-on": {"workload": "seed-mix"},
}
# Every mode a perf case runs in: each has its own record, summary file, reference and budget section.
CASE_MODES: tuple[str, ...] = (*SAMPLING_MODES, *PROMPT_MODES, *PREFIX_MODES)
# The client's own load over a level (bench.selfcheck, the busiest client process's): a client whose
# event loop lags sends late and stamps late, and at the highest levels one process can be the limit;
# and how late its requests went out (an open loop's send lag: one stall of the loop, rare enough for
# the lag's p99 to hide, shows here and in the longest stall). Recorded so that a level's figures say
# whether the client kept up; summaries stored before lack them (before 2026-12-07, the last two).
CLIENT_LOAD_KEYS = ("client_loop_lag_p99_s", "client_cpu_util", "client_loop_stall_s", "send_lag_p99_s")
# Closed-loop figures a case may add to CLOSED_LOOP_KEYS (folded where a trial has them): the prefix
# cache's hit rate, the server's own parts of the time to first token, the kernel variants it
# compiled (bench.server_metrics) and the client's load.
PREFIX_CACHE_KEYS = ("prefix_cache_hit_rate",)
OPTIONAL_CLOSED_LOOP_KEYS = (*PREFIX_CACHE_KEYS, *FIRST_TOKEN_KEYS, KERNEL_COMPILES_KEY, *CLIENT_LOAD_KEYS)

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
# The offline section (`bench offline`): each mode's figures, its step time and, for the engine, the
# step's phases (`step_<phase>_ms`, whatever the engine names), and the probes' figures.
OFFLINE_KEYS = (
    "served_req_s",
    "output_tok_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "tpot_p50_s",
    "e2e_p50_s",
    "failures",
    "steps",
    "step_ms",
    "single_ttft_s",
    "single_tpot_s",
    "prefill_tok_s",
)


def sweep_trial(result: SweepResult) -> dict[str, Any]:
    """One sweep as a trial records it (what summarize_trials folds): capacity, whether it was still
    rising, and each level's OPEN_LOOP_KEYS with the client's load beside them."""
    keys = (*OPEN_LOOP_KEYS, *CLIENT_LOAD_KEYS)
    return {
        "capacity_req_s": result.capacity_req_s,
        "capacity_still_rising": result.capacity_still_rising,
        "levels": [
            {"rate": level.summary["rate"], **{k: level.summary[k] for k in keys}} for level in result.levels
        ],
    }


def closed_level(concurrency: int, summary: Mapping[str, Any]) -> dict[str, Any]:
    """One closed-loop level as a trial records it: CLOSED_LOOP_KEYS and the client's load (a case
    adds its own optional figures beside them)."""
    return {"concurrency": concurrency, **{k: summary[k] for k in (*CLOSED_LOOP_KEYS, *CLIENT_LOAD_KEYS)}}


def summary_name(stem: str, mode: str) -> str:
    """The file of a target's (or an A/B side's) summary in a mode: `engine-seed-mix.json` for greedy,
    the name every stored baseline already has, `engine-seed-mix-sampled.json` for sampled (and
    `-text`, `-chat` for the prompt modes, `-cache-on`); a prefix mode of a workload of its own is
    named for it: `engine-shared-prefix.json`, `engine-multi-turn.json`."""
    if PREFIX_MODES.get(mode, {}).get("workload") == mode:
        return f"{stem}-{mode}.json"
    return f"{stem}-seed-mix{'' if mode == GREEDY else f'-{mode}'}.json"


def sampling_header(mode: str) -> dict[str, Any]:
    """What a summary says about its mode: a sampling mode's name and settings; a prompt mode's name
    (`mode`), its prompt format and API, and its sampling (greedy)."""
    if mode in PROMPT_MODES:
        return {"sampling": GREEDY, **SAMPLING_MODES[GREEDY], "mode": mode, **PROMPT_MODES[mode]}
    if mode in PREFIX_MODES:
        return {
            "sampling": GREEDY,
            **SAMPLING_MODES[GREEDY],
            "mode": mode,
            "prefix_cache": True,
            **PREFIX_MODES[mode],
        }
    return {"sampling": mode, **SAMPLING_MODES[mode]}


def sampling_mode(summary: Mapping[str, Any]) -> str:
    """The sampling mode a summary was measured in: its `sampling`, else greedy (a summary stored before
    the tier measured sampled workloads was greedy)."""
    return str(summary.get("sampling") or GREEDY)


def case_mode(summary: Mapping[str, Any]) -> str:
    """The perf tier's mode a summary was measured in: a prompt mode's `mode` (text, chat), else its
    sampling mode."""
    return str(summary.get("mode") or sampling_mode(summary))


def sampling_settings(meta: Mapping[str, Any]) -> tuple[float, float]:
    """(temperature, top_p) of a result: a summary's own keys, a run.json's workload (`bench run`,
    `bench offline`), else greedy's (results stored before the workload said how it samples)."""
    workload = (meta.get("config") or {}).get("workload") or {}
    source = meta if "temperature" in meta else workload
    return float(source.get("temperature", 0.0)), float(source.get("top_p", 1.0))


def describe_prompts(meta: Mapping[str, Any]) -> str:
    """How a result's prompts went out, as the report names it beside its sampling: "" for token ids
    over /v1/completions (every result before the prompt modes), ", text prompts" or ", chat
    completions", from a summary's own keys or a run.json's workload."""
    workload = (meta.get("config") or {}).get("workload") or {}
    source = meta if "prompt_format" in meta or "api" in meta else workload
    if source.get("api") == "chat":
        return ", chat completions"
    return ", text prompts" if source.get("prompt_format") == "text" else ""


def describe_sampling(temperature: float, top_p: float) -> str:
    """`greedy`, or `sampled (temperature 1, top_p 0.95)`: how the report and compare name it."""
    if temperature == 0:
        return GREEDY
    return f"sampled (temperature {temperature:g}, top_p {top_p:g})"


def spread(values: Sequence[float | None], key: str) -> dict[str, Any]:
    """{key: median, key_min: min, key_max: max, key_trials: each value in trial order} over the values
    that are numbers (the list is what bench.compare's tests on the trials read)."""
    numbers = [float(v) for v in values if v is not None and v == v]
    if not numbers:
        return {key: float("nan"), f"{key}_min": float("nan"), f"{key}_max": float("nan")}
    return {
        key: statistics.median(numbers),
        f"{key}_min": min(numbers),
        f"{key}_max": max(numbers),
        f"{key}_trials": numbers,
    }


def trial_values(entry: Mapping[str, Any], key: str) -> list[Any]:
    """A figure's value in each trial an entry holds: one trial's figure as it is; a folded entry's
    (`trials` > 1) from its `key_trials` list, so that folding folded entries again pools their trials
    instead of taking a median of medians. A folded figure without its list (a summary stored before
    the lists were) cannot be pooled: ValueError."""
    listed = entry.get(f"{key}_trials")
    if listed is not None:
        return list(listed)
    value = entry.get(key)
    if not known_figure(value) or _trial_count(entry) == 1:
        return [value]
    raise ValueError(
        f"{key} folds {entry['trials']} trials without each trial's value ({key}_trials): re-run them, "
        "or merge the single-trial summaries they were folded from"
    )


def _trial_count(entry: Mapping[str, Any]) -> int:
    return int(entry.get("trials", 1))


def fold_levels(
    trials: Sequence[Iterable[Mapping[str, Any]]], level_key: str, keys: Sequence[str]
) -> list[dict[str, Any]]:
    """Levels of several trials matched by `level_key` (rate or concurrency); a level some trials lack
    (sweep rates found by bisection can differ) is folded over the trials that have it. A level that
    is itself folded (`trials` > 1, from a summary) brings each of its trials (trial_values)."""
    by_level: dict[float, list[Mapping[str, Any]]] = {}
    for levels in trials:
        for level in levels:
            by_level.setdefault(float(level[level_key]), []).append(level)
    folded = []
    for value in sorted(by_level):
        levels = by_level[value]
        entry: dict[str, Any] = {level_key: value, "trials": sum(_trial_count(level) for level in levels)}
        for key in keys:
            entry.update(spread([v for level in levels for v in trial_values(level, key)], key))
        folded.append(entry)
    return folded


def _present(keys: Sequence[str], levels: Sequence[Mapping[str, Any]]) -> list[str]:
    """The optional figures some level has a number for: the ones a summary folds."""
    return [key for key in keys if any(known_figure(level.get(key)) for level in levels)]


def fold_offline(trials: Sequence[Mapping[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Offline sections of several trials, entry by entry (`all`, `closed-8`, `probes`): the median,
    min and max of each of OFFLINE_KEYS and of the step phases; an entry some trials lack is folded
    over the trials that have it."""
    folded: dict[str, dict[str, Any]] = {}
    keys = list(dict.fromkeys(key for section in trials for key in section))
    for key in keys:
        entries = [section[key] for section in trials if key in section]
        first = entries[0]
        entry: dict[str, Any] = {"mode": first.get("mode", key)}
        if "concurrency" in first:
            entry["concurrency"] = first["concurrency"]
        entry["trials"] = sum(_trial_count(e) for e in entries)
        names = [name for name in OFFLINE_KEYS if any(known_figure(e.get(name)) for e in entries)]
        names += list(
            dict.fromkeys(
                name
                for e in entries
                for name in e
                if name != "step_ms"
                and STEP_TIMING.match(name)
                and name not in names
                and known_figure(e[name])
            )
        )
        for name in names:
            entry.update(spread([v for e in entries for v in trial_values(e, name)], name))
        folded[key] = entry
    return folded


def summarize_trials(
    *,
    header: Mapping[str, Any],
    sweep_trials: Sequence[Mapping[str, Any]],
    closed_trials: Sequence[Sequence[Mapping[str, Any]]],
    trials: int,
    offline_trials: Sequence[Mapping[str, Mapping[str, Any]]] = (),
) -> dict[str, Any]:
    """The summary JSON. sweep_trials: one {"capacity_req_s", "capacity_still_rising", "levels"} per trial;
    closed_trials: for each trial, its closed-loop level summaries (OPTIONAL_CLOSED_LOOP_KEYS folded too
    where a level has them); offline_trials: each trial's offline section (an `offline` key only when there
    is one)."""
    extra = _present(OPTIONAL_CLOSED_LOOP_KEYS, [level for levels in closed_trials for level in levels])
    open_extra = _present(CLIENT_LOAD_KEYS, [level for trial in sweep_trials for level in trial["levels"]])
    summary: dict[str, Any] = dict(header)
    summary["trials"] = trials
    if sweep_trials:
        capacities = [v for t in sweep_trials for v in trial_values(t, "capacity_req_s")]
        summary.update(spread(capacities, "capacity_req_s"))
        summary["capacity_still_rising"] = any(t["capacity_still_rising"] for t in sweep_trials)
    else:
        summary["capacity_req_s"] = None
        summary["capacity_still_rising"] = None
    summary["open_loop"] = fold_levels(
        [t["levels"] for t in sweep_trials], "rate", (*OPEN_LOOP_KEYS, *open_extra)
    )
    summary["closed_loop"] = fold_levels(closed_trials, "concurrency", (*CLOSED_LOOP_KEYS, *extra))
    if offline_trials:
        summary["offline"] = fold_offline(offline_trials)
    return summary


def merge_summaries(
    summaries: Sequence[Mapping[str, Any]], sweep_from: Sequence[Mapping[str, Any]] | None = None
) -> dict[str, Any]:
    """Fold perf summaries of one target, measured in separate runs (or leases), into one summary
    over every trial they hold.

    A full-profile trial can take most of a time-limited command, so trials may be run one per
    command, or a few per lease, and merged afterwards. Each figure pools the trials' own values
    (trial_values: a summary of three trials brings three values, not its median), so one run of
    three trials and another of two merge into five. Inputs must agree on target, model, GPU,
    workload and sampling mode (a greedy and a sampled trial are two workloads). The result says
    what it came from: `merged_from` (each input's date) and `merged_trials` (each one's trials); an
    input merged before brings its own lists, so a stored reference re-merged with a new lease's trials
    still names every lease it pools.

    sweep_from: take the open-loop sweep (and capacity) from these runs instead, and only the closed
    loops from `summaries`: for sweeps re-run on their own (`pytest -m perf -k sweep`), or kept from
    an earlier lease while the closed loops are measured anew. The result says so in `sweep_from`
    (their dates) and `sweep_trials`.
    """
    if not summaries:
        raise ValueError("nothing to merge")
    first = summaries[0]
    for summary in [*summaries, *(sweep_from or [])]:
        if not isinstance(summary.get("trials"), int) or summary["trials"] < 1:
            raise ValueError(f"a summary without its number of trials: {summary.get('trials')!r}")
        for key in ("target", "model", "gpu", "workload"):
            if summary.get(key) != first.get(key):
                raise ValueError(f"summaries differ in {key}: {first.get(key)!r} vs {summary.get(key)!r}")
        if case_mode(summary) != case_mode(first):
            raise ValueError(
                f"summaries differ in sampling or prompt mode: {case_mode(first)!r} vs {case_mode(summary)!r}"
            )
    sweeps = summaries if sweep_from is None else sweep_from
    sweep_trials = [
        {
            "trials": _sweep_count(s),
            "capacity_req_s": s["capacity_req_s"],
            **({"capacity_req_s_trials": s["capacity_req_s_trials"]} if "capacity_req_s_trials" in s else {}),
            "capacity_still_rising": s["capacity_still_rising"],
            "levels": s["open_loop"],
        }
        for s in sweeps
        if s.get("capacity_req_s") is not None
    ]
    header = {
        k: v
        for k, v in first.items()
        if k not in ("open_loop", "closed_loop", "offline", "trials") and not k.startswith("capacity_")
    }
    header["merged_from"], header["merged_trials"] = _provenance(summaries)
    if sweep_from is not None:
        header["sweep_from"] = [s.get("date") for s in sweep_from]
        header["sweep_trials"] = sum(t["trials"] for t in sweep_trials)
    closed = [list(s.get("closed_loop") or []) for s in summaries]
    offline = [s["offline"] for s in summaries if s.get("offline")]
    return summarize_trials(
        header=header,
        sweep_trials=sweep_trials,
        closed_trials=closed,
        trials=_merged_trials(summaries, sweep_from is None),
        offline_trials=offline,
    )


def _sweep_count(summary: Mapping[str, Any]) -> int:
    """How many open-loop sweeps a summary's capacity pools: its list of each sweep's capacity where
    it has one, else what a merge recorded (`sweep_trials`), else its trials. Not `trials` first: a
    reference whose closed loops were re-measured (three trials) may keep one sweep of an earlier lease."""
    listed = summary.get("capacity_req_s_trials")
    if listed is not None:
        return len(listed)
    return int(summary.get("sweep_trials") or summary["trials"])


def _provenance(summaries: Sequence[Mapping[str, Any]]) -> tuple[list[Any], list[int]]:
    """Each input run's date and trial count; a merged input stands for the runs it lists."""
    dates: list[Any] = []
    trials: list[int] = []
    for summary in summaries:
        listed, counts = summary.get("merged_from"), summary.get("merged_trials")
        if isinstance(listed, list) and isinstance(counts, list) and len(listed) == len(counts) > 0:
            dates += listed
            trials += counts
        else:
            dates.append(summary.get("date"))
            trials.append(summary["trials"])
    return dates, trials


def _merged_trials(summaries: Sequence[Mapping[str, Any]], with_sweep: bool) -> int:
    """The trials a merged summary holds: the most that any one of its figures pools. Runs that
    measured different levels (one cut short, the rest measured in another) do not add up: three
    trials of 1-128 in flight and three of 256 are three trials, not six."""
    counts: dict[str, int] = {}
    for summary in summaries:
        parts = [f"closed {level.get('concurrency')}" for level in summary.get("closed_loop") or []]
        parts += ["sweep"] if with_sweep and summary.get("capacity_req_s") is not None else []
        parts += ["offline"] if summary.get("offline") else []
        for part in parts or ["whole"]:
            counts[part] = counts.get(part, 0) + summary["trials"]
    return max(counts.values())

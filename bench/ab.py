"""`bench ab BASE_REF NEW_REF`: two commits of the engine measured on one machine in one job, then
the regression gate (bench.compare's rule) on that pair.

Each ref is checked out in a git worktree of its own and its server (`python -m server`) is started
from there, so each side runs its own engine and server; this checkout's bench measures both. Trials
come in pairs ordered A B, B A, A B... (a steady drift of the machine favours neither side); while
trials too few to tell a drop from noise leave the comparison unreliable, pairs are added up to
`max_trials`. Each trial starts that side's server, warms it up (kept out of every figure),
runs the profile's sweep and closed loops, and stops it, so only one server holds the GPU and slow
drifts of the machine fall on both sides alike. Each side's trials fold into a summary (median, min,
max; bench.trials) that `bench compare` reads, and `run_ab` returns their Comparison. A profile that
runs the sampled mode too (bench.profiles: full, short, smoke) measures both modes in every trial,
against the same warm server, and each mode is compared on its own (`{side}-seed-mix.json`,
`{side}-seed-mix-sampled.json`); the one Comparison holds both, the sampled rows named `sampled: ...`.

The pairing (`run_pairs`), one trial's measurement against a warm server (`measure`) and the fold and
comparison (`fold_side`, `compare_sides`) serve any two servers measured on one machine, not only two
commits: tests/unit/bench/test_smoke_catches_slowdown.py holds a 2x slowed engine to the normal one.
"""

from __future__ import annotations

import datetime
import json
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.client import Endpoint
from bench.compare import DEFAULT_MAX_DROP, EXIT_UNRELIABLE, Comparison, combine, compare_results
from bench.launch import ServerProcess, ServerSpec
from bench.machine import describe_machine
from bench.metrics import describe_failures
from bench.probe import first_model
from bench.profiles import Profile, seed_mix
from bench.results import json_safe
from bench.runner import run_closed_loop, run_sweep, sweep_failures
from bench.trials import (
    GREEDY,
    closed_level,
    sampling_header,
    summarize_trials,
    summary_name,
    sweep_trial,
)
from bench.workload import WorkloadSpec

SIDES = ("base", "new")


class AbError(RuntimeError):
    """A ref that does not resolve, a worktree that cannot be made, a server that does not start."""


@dataclass
class AbConfig:
    base_ref: str
    new_ref: str
    model_dir: str
    profile: Profile
    trials: int = 3
    # Up to this many trials a side, one pair at a time, while the comparison is unreliable; None or
    # no more than `trials`: stop at `trials`.
    max_trials: int | None = None
    dtype: str = "bfloat16"
    repo: str = "."
    work_dir: str = "perf-out/ab"  # worktrees, server logs, each side's summary
    start_timeout_s: float = 300.0
    max_drop: Mapping[str, float] = field(default_factory=lambda: dict(DEFAULT_MAX_DROP))
    log: Callable[[str], None] = print


@dataclass
class AbResult:
    summaries: dict[str, dict[str, dict[str, Any]]]  # mode -> side -> summary (as the perf tier's)
    paths: dict[str, dict[str, Path]]  # mode -> side -> its summary file
    comparison: Comparison  # every mode's rows, the sampled ones named `sampled: ...`


def _git(repo: str | Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise AbError(f"git {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def resolve(repo: str | Path, ref: str) -> str:
    """The commit a ref names, or AbError."""
    return _git(repo, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}")


def add_worktree(repo: str | Path, commit: str, folder: Path) -> Path:
    """A detached worktree of `commit` at `folder` (replacing a stale one left by an earlier run)."""
    if folder.exists():
        remove_worktree(repo, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    _git(repo, "worktree", "add", "--detach", "--force", str(folder), commit)
    return folder


def remove_worktree(repo: str | Path, folder: Path) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "worktree", "remove", "--force", str(folder)], capture_output=True
    )
    subprocess.run(["git", "-C", str(repo), "worktree", "prune"], capture_output=True)


def measure(endpoint: Endpoint, workload: WorkloadSpec, profile: Profile) -> dict[str, Any]:
    """One trial against a warm server: the profile's sweep (if any) and its closed loops, in the
    shapes bench.trials.summarize_trials folds (bench.trials.sweep_trial, closed_level: each level with
    the client's own load, so a side whose figures the client capped shows it), and the failed
    requests' descriptions."""
    trial: dict[str, Any] = {"sweep": None, "closed": [], "failed": []}
    if profile.sweep is not None:
        result = run_sweep(endpoint, workload, profile.sweep_load, profile.sweep)
        failures, _turned_away = sweep_failures(result)  # 429/503 past saturation is load shedding
        trial["failed"] += failures
        trial["sweep"] = sweep_trial(result)
    for concurrency in profile.concurrencies:
        level = run_closed_loop(endpoint, workload, concurrency, profile.closed_load)
        trial["failed"] += [f"concurrency {concurrency}: {line}" for line in describe_failures(level.rows)]
        trial["closed"].append(closed_level(concurrency, level.summary))
    return trial


def run_trial(config: AbConfig, side: str, worktree: Path, number: int) -> dict[str, dict[str, Any]]:
    """Start `side`'s server from its worktree, warm it up in each sampling mode of the profile,
    measure one trial of each mode (`measure`), always stop it. Returns {mode: that mode's trial}."""
    spec = ServerSpec.for_target("engine", config.model_dir, config.dtype)
    spec.cwd = str(worktree)
    log_path = Path(config.work_dir) / f"{side}-server-{number}.log"
    with ServerProcess(spec, log_path) as process:
        try:
            process.start(timeout_s=config.start_timeout_s)
        except (RuntimeError, TimeoutError) as exc:
            raise AbError(f"{side} server ({worktree}) did not start: {exc}") from exc
        endpoint = Endpoint(spec.base_url, model=first_model(spec.base_url), target=side)
        for mode in config.profile.sampling:  # kept out of every figure, each mode's path warmed
            warmup = seed_mix(mode, seed=1)
            run_closed_loop(endpoint, warmup, config.profile.warmup_concurrency, config.profile.warmup)
        trial = {
            mode: measure(endpoint, seed_mix(mode), config.profile.for_mode(mode))
            for mode in config.profile.sampling
        }
    for measured in trial.values():
        measured["server_ready_s"] = process.ready_after_s
    return trial


def pair_order(number: int) -> tuple[str, str]:
    """The sides of trial pair `number` (1-based): base then new, then new then base, and so on
    (A B B A A B ...), so a machine that drifts steadily over the job favours neither side."""
    return SIDES if number % 2 == 1 else (SIDES[1], SIDES[0])


Trials = dict[str, list[dict[str, Any]]]  # side -> its trials so far, in the order they ran


def run_pairs(
    measure_side: Callable[[str, int], dict[str, Any]],
    compare: Callable[[Trials], Comparison],
    trials: int,
    max_trials: int | None = None,
    log: Callable[[str], None] = print,
    labels: Mapping[str, str] | None = None,
) -> tuple[Trials, Comparison]:
    """`trials` pairs of trials ordered A B, B A, ... (`pair_order`; `measure_side(side, number)`
    measures one); then, while `compare` of the trials so far says unreliable (trials too few to tell
    a drop from noise) and fewer than `max_trials` trials a side have run, one more pair. Returns each
    side's trials and the last comparison. `labels` name the sides in the log (a commit, a setting)."""
    measured: Trials = {side: [] for side in SIDES}
    limit = max(trials, max_trials or trials)

    def measure_pair(number: int, total: int) -> None:
        for side in pair_order(number):
            log(f"bench ab: trial {number}/{total} of {side}{f' ({labels[side]})' if labels else ''}")
            measured[side].append(measure_side(side, number))

    for number in range(1, trials + 1):
        measure_pair(number, trials)
    comparison = compare(measured)
    while comparison.exit_status() == EXIT_UNRELIABLE and len(measured["base"]) < limit:
        number = len(measured["base"]) + 1
        log(
            f"bench ab: {len(comparison.unreliable)} row(s) unreliable; one more trial a side "
            f"({number} of at most {limit})"
        )
        measure_pair(number, limit)
        comparison = compare(measured)
    return measured, comparison


def fold_side(header: Mapping[str, Any], trials: list[dict[str, Any]]) -> dict[str, Any]:
    """One side's trials (`measure`'s shape) folded into a summary as the perf tier writes them:
    `header`, then each figure's median, min, max and each trial's value (bench.trials)."""
    return summarize_trials(
        header={**header, "failed_requests": [line for trial in trials for line in trial["failed"]]},
        sweep_trials=[trial["sweep"] for trial in trials if trial["sweep"] is not None],
        closed_trials=[trial["closed"] for trial in trials],
        trials=len(trials),
    )


def compare_sides(
    summaries: Mapping[str, dict[str, Any]],
    work_dir: str | Path,
    max_drop: Mapping[str, float],
    mode: str = GREEDY,
) -> tuple[Comparison, dict[str, Path]]:
    """Each side's summary of one sampling mode written to work_dir/<side>-seed-mix.json (greedy) or
    <side>-seed-mix-sampled.json, and new compared with base by the gate's rule (bench.compare) at
    `max_drop`."""
    paths = {side: Path(work_dir) / summary_name(side, mode) for side in SIDES}
    for side in SIDES:
        paths[side].write_text(json.dumps(json_safe(summaries[side]), indent=2) + "\n")
    return compare_results(paths["base"], paths["new"], max_drop), paths


def run_ab(config: AbConfig) -> AbResult:
    """Both refs, `trials` each, in pairs ordered A B B A ... (`run_pairs`), each trial a server of
    its own (`run_trial`, every sampling mode of the profile), more pairs while the comparison of any
    mode is unreliable, up to `max_trials`. Each side's summary of each mode is written to
    work_dir/<side>-seed-mix.json or <side>-seed-mix-sampled.json; returns the comparison of new
    against base, every mode's rows in one (`combine`)."""
    refs = {"base": config.base_ref, "new": config.new_ref}
    commits = {side: resolve(config.repo, refs[side]) for side in SIDES}
    work = Path(config.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    worktrees: dict[str, Path] = {}
    machine = describe_machine()

    def summaries(trials: Trials, mode: str) -> dict[str, dict[str, Any]]:
        return {
            side: fold_side(
                {**_header(config, refs, commits, side, trials, machine), **sampling_header(mode)},
                [trial[mode] for trial in trials[side]],
            )
            for side in SIDES
        }

    def compare(trials: Trials) -> tuple[Comparison, dict[str, dict[str, Path]]]:
        compared = {
            mode: compare_sides(summaries(trials, mode), work, config.max_drop, mode)
            for mode in config.profile.sampling
        }
        comparison = combine({mode: pair[0] for mode, pair in compared.items()})
        return comparison, {mode: pair[1] for mode, pair in compared.items()}

    try:
        for side in SIDES:
            worktrees[side] = add_worktree(config.repo, commits[side], (work / f"worktree-{side}").resolve())
        trials, _ = run_pairs(
            lambda side, number: run_trial(config, side, worktrees[side], number),
            lambda trials: compare(trials)[0],
            config.trials,
            config.max_trials,
            config.log,
            labels={side: commits[side][:12] for side in SIDES},
        )
    finally:
        for folder in worktrees.values():
            remove_worktree(config.repo, folder)
    comparison, paths = compare(trials)
    folded = {mode: summaries(trials, mode) for mode in config.profile.sampling}
    return AbResult(folded, paths, comparison)


def _header(
    config: AbConfig,
    refs: Mapping[str, str],
    commits: Mapping[str, str],
    side: str,
    trials: Trials,
    machine: dict[str, Any],
) -> dict[str, Any]:
    """What a side's summary says about it besides its figures: ref, commit, model, profile, machine."""
    return {
        "target": f"{side} {refs[side]} ({commits[side][:12]})",
        "ref": refs[side],
        "commit": commits[side],
        "model": Path(config.model_dir).name,
        "dtype": config.dtype,
        "workload": "seed-mix",
        "profile": config.profile.name,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "ab": {
            "order": "pairs A B, B A, A B, ...",
            "trials": len(trials[side]),
            "planned_trials": config.trials,
        },
    }

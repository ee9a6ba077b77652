"""The perf cases: bench's seed-mix workload as an open-loop sweep to saturation, and closed loops,
each in every mode its profile runs it in (`mode`: greedy, sampled; the closed loops also text and
chat, the seed-mix sent as text prompts and as chat completions).

Each case runs `--trials` timed rounds through pytest-benchmark (so --benchmark-json holds every
figure, in bench's flat keys, in extra_info), hands the figures to the recorder, and asserts the
budgets against the reference (vLLM, or a stored result) for this GPU, model and mode.
"""

from __future__ import annotations

import pytest

from bench.budgets import check_closed, check_sweep
from bench.metrics import describe_failures
from bench.runner import run_closed_loop, run_sweep, sweep_failures
from bench.server_metrics import level_figures, level_names, read_settled_totals
from bench.trials import (
    CLOSED_LOOP_KEYS,
    OPTIONAL_CLOSED_LOOP_KEYS,
    closed_level,
    fold_levels,
    sweep_trial,
)

pytestmark = pytest.mark.perf


def test_open_loop_sweep(benchmark, server, target, mode, workload, profile, sweep, perf, recorder):
    trials = []
    failed: list[str] = []
    shed: list[str] = []
    warned: list[str] = []  # the runner's warnings of a level (a lagging client, late sends)

    def trial() -> None:
        result = run_sweep(server.endpoint, workload, profile.sweep_load, sweep)
        failures, turned_away = sweep_failures(result)
        failed.extend(failures)
        shed.extend(turned_away)
        warned.extend(note for level in result.levels for note in level.warnings)
        trials.append(sweep_trial(result))

    benchmark.pedantic(trial, rounds=perf.trials, iterations=1)
    record = recorder.record(target, mode)
    record.sweep_trials = trials
    summary = record.summary(perf.trials)
    benchmark.extra_info.update(
        {key: value for key, value in summary.items() if key.startswith("capacity_")},
        target=target,
        sampling=record.header["sampling"],
        mode=mode,
        case="sweep",
        open_loop=summary["open_loop"],
    )
    record.notes.extend(f"failed requests, {line}" for line in failed)
    record.notes.extend(f"turned away, {line}" for line in shed)
    record.notes.extend(warned)
    assert not failed, "requests failed during the sweep:\n" + "\n".join(failed)
    recorder.check(
        target,
        mode,
        lambda reference, budgets: check_sweep(
            summary["capacity_req_s"], summary["open_loop"], reference, budgets
        ),
    )


def test_closed_loop(benchmark, server, target, mode, workload, profile, concurrency, perf, recorder):
    trials = []
    failed: list[str] = []
    noted: list[str] = []
    warned: list[str] = []  # the runner's warnings of the level, already labelled with it

    def trial() -> None:
        # the server's own figures of the level (its split of the time to first token, the kernel
        # variants it compiled), where its /metrics has them
        before = read_settled_totals(server.endpoint, level_names())
        result = run_closed_loop(server.endpoint, workload, concurrency, profile.closed_load)
        after = read_settled_totals(server.endpoint, level_names())
        failed.extend(describe_failures(result.rows))
        warned.extend(result.warnings)
        trials.append({**closed_level(concurrency, result.summary), **level_figures(before, after)})
        if result.summary.get("prompt_tokens_mismatched"):
            noted.append(prompt_tokens_note(result.summary))
        if result.summary.get("no_text"):
            noted.append(
                f"{result.summary['no_text']} of {result.summary['completed']} streams brought tokens but "
                "no text (all decoded to nothing): counted in tokens/s, left out of TTFT and TPOT"
            )

    benchmark.pedantic(trial, rounds=perf.trials, iterations=1)
    record = recorder.record(target, mode)
    record.closed_trials[concurrency] = trials
    keys = (*CLOSED_LOOP_KEYS, *(key for key in OPTIONAL_CLOSED_LOOP_KEYS if key in trials[0]))
    folded = fold_levels([[t] for t in trials], "concurrency", keys)[0]
    benchmark.extra_info.update(
        folded, target=target, sampling=record.header["sampling"], mode=mode, case="closed_loop"
    )
    record.notes.extend(f"failed requests, concurrency {concurrency}: {line}" for line in failed)
    record.notes.extend(f"concurrency {concurrency}: {line}" for line in noted)
    record.notes.extend(warned)
    assert folded["failures_max"] == 0, (
        f"{folded['failures_max']:g} requests failed at concurrency {concurrency}:\n" + "\n".join(failed)
    )
    recorder.check(
        target, mode, lambda reference, budgets: check_closed(concurrency, folded, reference, budgets)
    )


def prompt_tokens_note(summary: dict) -> str:
    """What the record says when the server counted prompts at other lengths than the workload's
    (bench.metrics.check_prompt_tokens): shown, not failed, since a server may count a BOS token."""
    return (
        f"prompt tokens: the server counted {summary['prompt_tokens_mismatched']} of "
        f"{summary['prompt_tokens_checked']} prompts at another length ({summary['prompt_tokens_mismatch_pct']:.1f} %), "
        f"{summary['prompt_tokens_outside_tolerance']} outside tolerance, largest difference "
        f"{summary['prompt_tokens_off_max']:+d} tokens"
    )

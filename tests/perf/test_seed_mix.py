"""The perf cases: bench's seed-mix workload as an open-loop sweep to saturation, and closed loops,
each in every sampling mode its profile runs it in (`sampling`: greedy, sampled).

Each case runs `--trials` timed rounds through pytest-benchmark (so --benchmark-json holds every
figure, in bench's flat keys, in extra_info), hands the figures to the recorder, and asserts the
budgets against the reference (vLLM, or a stored result) for this GPU, model and sampling mode.
"""

from __future__ import annotations

import pytest

from bench.budgets import check_closed, check_sweep
from bench.metrics import describe_failures
from bench.runner import run_closed_loop, run_sweep, sweep_failures
from bench.trials import CLOSED_LOOP_KEYS, OPEN_LOOP_KEYS, fold_levels

pytestmark = pytest.mark.perf


def test_open_loop_sweep(benchmark, server, target, sampling, workload, profile, sweep, perf, recorder):
    trials = []
    failed: list[str] = []
    shed: list[str] = []

    def trial() -> None:
        result = run_sweep(server.endpoint, workload, profile.sweep_load, sweep)
        failures, turned_away = sweep_failures(result)
        failed.extend(failures)
        shed.extend(turned_away)
        levels = [
            {"rate": level.summary["rate"], **{k: level.summary[k] for k in OPEN_LOOP_KEYS}}
            for level in result.levels
        ]
        trials.append(
            {
                "capacity_req_s": result.capacity_req_s,
                "capacity_still_rising": result.capacity_still_rising,
                "levels": levels,
            }
        )

    benchmark.pedantic(trial, rounds=perf.trials, iterations=1)
    record = recorder.record(target, sampling)
    record.sweep_trials = trials
    summary = record.summary(perf.trials)
    benchmark.extra_info.update(
        {key: value for key, value in summary.items() if key.startswith("capacity_")},
        target=target,
        sampling=sampling,
        case="sweep",
        open_loop=summary["open_loop"],
    )
    record.notes.extend(f"failed requests, {line}" for line in failed)
    record.notes.extend(f"turned away, {line}" for line in shed)
    assert not failed, "requests failed during the sweep:\n" + "\n".join(failed)
    recorder.check(
        target,
        sampling,
        lambda reference, budgets: check_sweep(
            summary["capacity_req_s"], summary["open_loop"], reference, budgets
        ),
    )


def test_closed_loop(benchmark, server, target, sampling, workload, profile, concurrency, perf, recorder):
    trials = []
    failed: list[str] = []

    def trial() -> None:
        result = run_closed_loop(server.endpoint, workload, concurrency, profile.closed_load)
        failed.extend(describe_failures(result.rows))
        trials.append({"concurrency": concurrency, **{k: result.summary[k] for k in CLOSED_LOOP_KEYS}})

    benchmark.pedantic(trial, rounds=perf.trials, iterations=1)
    record = recorder.record(target, sampling)
    record.closed_trials[concurrency] = trials
    folded = fold_levels([[t] for t in trials], "concurrency", CLOSED_LOOP_KEYS)[0]
    benchmark.extra_info.update(folded, target=target, sampling=sampling, case="closed_loop")
    record.notes.extend(f"failed requests, concurrency {concurrency}: {line}" for line in failed)
    assert folded["failures_max"] == 0, (
        f"{folded['failures_max']:g} requests failed at concurrency {concurrency}:\n" + "\n".join(failed)
    )
    recorder.check(
        target, sampling, lambda reference, budgets: check_closed(concurrency, folded, reference, budgets)
    )

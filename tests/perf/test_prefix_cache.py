"""The prefix-cache cases: closed loops against each target's server with its prefix cache on, in each
prefix mode its profile runs (`mode`: shared-prefix, multi-turn, and cache-on, the seed-mix that shares
nothing: what the cache costs).

Every level of every trial starts from an empty cache (POST /reset_prefix_cache) with prompts of its
own (a fresh seed, the same for both targets), so one level's prompts never make another's hits
(bench.prefix.run_fresh_level). Each trial's hit rate comes from the server's counters; the figures are
held to the reference of the same mode (vLLM with its cache on, or a stored result) by `[vllm.<mode>]`
budgets, skipped by name until one is set.
"""

from __future__ import annotations

import math

import pytest

from bench.budgets import check_closed
from bench.metrics import describe_failures
from bench.prefix import run_fresh_level
from bench.profiles import prefix_workload
from bench.trials import (
    CLOSED_LOOP_KEYS,
    OPTIONAL_CLOSED_LOOP_KEYS,
    PREFIX_CACHE_KEYS,
    closed_level,
    fold_levels,
)

pytestmark = pytest.mark.perf


def test_prefix_cache(benchmark, cached_server, target, mode, profile, concurrency, perf, recorder):
    workload = prefix_workload(mode, profile.prefix_shape, concurrency)
    trials: list[dict] = []
    failed: list[str] = []
    notes: list[str] = []

    def trial() -> None:
        # a level number of its own for every trial and concurrency: its seed (and so its prompts,
        # prefixes and conversations) differs from every other level's, and is the same for both targets
        level = 1000 * len(trials) + concurrency
        result = run_fresh_level(cached_server.endpoint, workload, concurrency, profile.closed_load, level)
        failed.extend(describe_failures(result.rows))
        notes.extend(result.warnings)
        summary = result.summary
        trials.append(
            {
                **closed_level(concurrency, summary),
                **{key: summary[key] for key in PREFIX_CACHE_KEYS if key in summary},
            }
        )

    benchmark.pedantic(trial, rounds=perf.trials, iterations=1)
    record = recorder.record(target, mode)
    record.closed_trials[concurrency] = trials
    keys = (*CLOSED_LOOP_KEYS, *(key for key in OPTIONAL_CLOSED_LOOP_KEYS if key in trials[0]))
    folded = fold_levels([[t] for t in trials], "concurrency", keys)[0]
    benchmark.extra_info.update(folded, target=target, mode=mode, case="prefix_cache", prefix_cache=True)
    rate = folded.get("prefix_cache_hit_rate", math.nan)
    record.notes.append(
        f"concurrency {concurrency}: prefix cache hit rate {rate:.3f}"
        if math.isfinite(rate)
        else f"concurrency {concurrency}: the server exposes no prefix cache counters on /metrics"
    )
    record.notes.extend(dict.fromkeys(notes))
    record.notes.extend(f"failed requests, concurrency {concurrency}: {line}" for line in failed)
    assert folded["failures_max"] == 0, (
        f"{folded['failures_max']:g} requests failed at concurrency {concurrency}:\n" + "\n".join(failed)
    )
    recorder.check(
        target, mode, lambda reference, budgets: check_closed(concurrency, folded, reference, budgets)
    )

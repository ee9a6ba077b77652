"""The sweep against a slow continuous-batching server: requests take 5-12 s, levels 15 s.

A pretend server (no network) serves each level by simulating decode steps: every running request
gains one token a step, a step takes 30 ms + 0.65 ms per running request, at most 256 run at once
and the rest queue. It sustains about 10 req/s of 1-256-token requests. Judged by the served rate of
a 15-s level against its own median latency, such a server looked saturated at 1 req/s.
"""

from __future__ import annotations

import random

import pytest

from bench import runner
from bench.client import Endpoint
from bench.metrics import RequestRow, summarize
from bench.runner import LevelResult, LoadConfig, SweepConfig, SweepResult, run_sweep, sweep_failures
from bench.workload import WorkloadSpec, arrival_offsets

STEP_S, PER_SEQUENCE_S, MAX_RUNNING = 0.030, 0.00065, 256
MEAN_TOKENS = 128.5  # lengths uniform over 1..256
SUSTAINED_REQ_S = MAX_RUNNING / (STEP_S + PER_SEQUENCE_S * MAX_RUNNING) / MEAN_TOKENS  # ~10.1


def serve_level(rate: float, load: LoadConfig, seed: int, max_waiting: int | None = None) -> list[RequestRow]:
    """`max_waiting`: admission control; an arrival that finds that many queued gets HTTP 503."""
    rng = random.Random(seed)
    arrivals = arrival_offsets(rate, n=None, duration_s=load.duration_s, arrival="poisson", seed=seed)
    rows = [
        RequestRow("slow", "open", rate, None, seed, i, False, 64, rng.randint(1, 256), t, t)
        for i, t in enumerate(arrivals)
    ]
    left = {row.index: row.max_tokens for row in rows}
    waiting, running, now, nxt = [], [], 0.0, 0
    while nxt < len(rows) or waiting or running:
        while nxt < len(rows) and rows[nxt].scheduled_s <= now:
            row = rows[nxt]
            if max_waiting is not None and len(waiting) >= max_waiting:
                row.status, row.error, row.done_s = "http_503", "too many pending requests", row.scheduled_s
            else:
                waiting.append(row)
            nxt += 1
        while waiting and len(running) < MAX_RUNNING:
            running.append(waiting.pop(0))
        if not running:
            now = rows[nxt].scheduled_s
            continue
        now += STEP_S + PER_SEQUENCE_S * len(running)
        for row in list(running):
            if row.first_token_s is None:
                row.first_token_s = now
            left[row.index] -= 1
            if left[row.index] == 0:
                row.done_s, row.output_tokens = now, row.max_tokens
                running.remove(row)
    return rows


def level_result(rate: float, rows: list[RequestRow]) -> LevelResult:
    """What run_open_loop returns for these rows (the pretend servers stand in for it)."""
    return LevelResult({"rate": rate, **summarize(rows)}, rows, [])


def sweep(config: SweepConfig) -> SweepResult:
    """A sweep of 15-s base levels against whichever pretend server replaced run_open_loop."""
    return run_sweep(
        Endpoint("http://unused/v1", "m"),
        WorkloadSpec(kind="seed-mix"),
        LoadConfig(duration_s=15.0, progress=False),
        config,
    )


@pytest.fixture
def pretend_slow_server(monkeypatch):
    loads: list[tuple[float, LoadConfig]] = []

    def pretend(endpoint, workload, rate, load, clock_zero=None):
        loads.append((rate, load))
        rows = serve_level(rate, load, seed=len(loads))
        return level_result(rate, rows)

    monkeypatch.setattr(runner, "run_open_loop", pretend)
    return loads


def test_a_slow_server_is_not_called_saturated_and_its_capacity_is_found(pretend_slow_server):
    result = sweep(SweepConfig(start_rate=1.0, max_levels=10))
    rates = [rate for rate, _ in pretend_slow_server]
    durations = [load.duration_s for _, load in pretend_slow_server]
    assert rates[:4] == [1.0, 2.0, 4.0, 8.0], "1-8 req/s are below what it sustains"
    assert result.capacity_req_s == pytest.approx(SUSTAINED_REQ_S, rel=0.15)
    assert not result.capacity_still_rising
    # Levels grow with the latency where the server kept up: 4 x its p90 (up to 2x the lowest rate's).
    first_p90 = result.levels[0].summary["e2e_p90_s"]
    assert durations[0] == 15.0 and durations[1] == pytest.approx(4 * first_p90)
    assert all(15.0 <= d <= 4 * 2 * first_p90 + 1e-9 for d in durations)


def test_a_fast_server_keeps_short_levels(monkeypatch):
    """Latency far under the level: no level is stretched (the sweep costs what it did)."""
    loads = []

    def pretend(endpoint, workload, rate, load, clock_zero=None):
        loads.append(load.duration_s)
        arrivals = arrival_offsets(rate, n=None, duration_s=load.duration_s, seed=1)
        rows, free = [], 0.0
        for i, t in enumerate(arrivals):  # a queue served at 50 req/s, 0.5 s a request
            free = max(t, free) + 1 / 50
            row = RequestRow("fast", "open", rate, None, 0, i, False, 64, 16, t, t)
            row.first_token_s, row.done_s, row.output_tokens = free + 0.05, free + 0.5, 16
            rows.append(row)
        return level_result(rate, rows)

    monkeypatch.setattr(runner, "run_open_loop", pretend)
    result = sweep(SweepConfig(start_rate=4.0))
    assert set(loads) == {15.0}
    assert result.capacity_req_s == pytest.approx(50.0, rel=0.1)


def test_requests_turned_away_past_saturation_are_not_failures(monkeypatch):
    """Admission control (503 once 8 wait) sheds load only where the sweep found it saturated; a
    broken request anywhere is still a failure."""

    def pretend(endpoint, workload, rate, load, clock_zero=None):
        rows = serve_level(rate, load, seed=int(rate), max_waiting=8)
        if rate == 1.0:
            rows[0].status, rows[0].error = "stream_error", "ReadError('')"
        return level_result(rate, rows)

    monkeypatch.setattr(runner, "run_open_loop", pretend)
    result = sweep(SweepConfig(start_rate=1.0, max_levels=10, max_level_s=30.0))
    failed, turned_away = sweep_failures(result)
    shed_levels = {level.summary["rate"] for level in result.levels if level.summary["failures"]} - {1.0}
    assert shed_levels, "the limit is reached above capacity"
    assert all(
        not level.summary["kept_up"] for level in result.levels if level.summary["rate"] in shed_levels
    )
    assert failed == ["rate 1/s: stream_error x1: ReadError('')"]
    assert len(turned_away) == len(shed_levels)
    assert all("past saturation: http_503" in line for line in turned_away)

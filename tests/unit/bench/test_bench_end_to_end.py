"""Every metric end to end: the real client and runner against a fake server in its own process whose
TTFT, ITL and slot count are known, so the measured figures must come out near the configured ones.

Tolerances leave room for a loaded 2-core machine: a few ms per timestamp, 15 % on rates. The figures
held are the fake server's own configured pace (what each metric must read back), not a speed of this
project's code; the module runs in the serial invocation, so no other test worker shares the cores.
"""

import asyncio
import gc
import time
from collections import Counter

import pytest

from bench import runner
from bench.client import Endpoint, make_http_client
from bench.fake_server import FakeServerConfig, FakeServerProcess
from bench.metrics import Slo
from bench.probe import check_streaming
from bench.runner import LevelResult, LoadConfig, SweepConfig, run_closed_loop, run_open_loop, run_sweep
from bench.selfcheck import ClientLoad, ClientMonitor, full_collections_held
from bench.workload import WorkloadSpec

TTFT, ITL, SLOTS, TOKENS = 0.1, 0.01, 4, 20
E2E = TTFT + (TOKENS - 1) * ITL  # 0.29 s for a request that gets a slot at once
CAPACITY = SLOTS / E2E  # requests/s the fake server can serve
FIXED = WorkloadSpec(kind="fixed", input_len=16, output_len=TOKENS)
pytestmark = pytest.mark.serial


def load(**kwargs):
    return LoadConfig(**{"progress": False, **kwargs})


@pytest.fixture(scope="module")
def server():
    with FakeServerProcess(FakeServerConfig(ttft_s=TTFT, itl_s=ITL, slots=SLOTS)) as fake:
        endpoint = Endpoint(fake.base_url, "fake-model", target="fake")
        run_closed_loop(
            endpoint, FIXED, SLOTS, load(n_requests=SLOTS)
        )  # a fresh server's first requests are slow
        yield endpoint


def test_closed_loop_within_capacity(server):
    result = run_closed_loop(server, FIXED, SLOTS, load(n_requests=12, warmup=4))
    s = result.summary
    assert len(result.rows) == 16 and sum(row.warmup for row in result.rows) == 4
    assert (s["n_requests"], s["completed"], s["failures"]) == (12, 12, 0)
    assert TTFT <= s["ttft_p50_s"] < TTFT + 0.03
    assert s["itl_p50_s"] == pytest.approx(ITL, abs=0.003)
    assert s["tpot_p50_s"] == pytest.approx(ITL, abs=0.002)
    assert E2E <= s["e2e_p50_s"] < E2E + 0.04
    assert s["served_req_s"] == pytest.approx(CAPACITY, rel=0.15)
    assert s["output_tok_s"] == pytest.approx(s["served_req_s"] * TOKENS, rel=1e-9)
    assert s["goodput_req_s"] == s["served_req_s"]  # TTFT 0.1 <= 0.5 and TPOT 0.01 <= 0.05
    assert s["send_lag_p99_s"] < 0.02
    assert all(row.output_tokens == TOKENS and row.chunks == TOKENS for row in result.rows)
    assert s["client_loop_lag_p99_s"] < 0.05 and 0 <= s["client_cpu_util"] < 1


def test_closed_loop_past_the_slots_queues(server):
    """Twice as many in flight as slots: after the first wave every request waits one whole request."""
    s = run_closed_loop(server, FIXED, 2 * SLOTS, load(n_requests=16, slo=Slo(ttft_s=0.2))).summary
    assert s["ttft_p50_s"] == pytest.approx(E2E + TTFT, abs=0.04)
    assert s["served_req_s"] == pytest.approx(CAPACITY, rel=0.15)
    assert s["tpot_p50_s"] == pytest.approx(ITL, abs=0.002)
    # only the first wave, which got slots at once, has a TTFT within 0.2 s
    assert s["goodput_req_s"] == pytest.approx(s["served_req_s"] * 4 / 16, rel=1e-9)


def test_open_loop_below_capacity(server):
    rate, n = 8.0, 8
    result = run_open_loop(server, FIXED, rate, load(n_requests=n, arrival="constant"))
    s = result.summary
    assert [row.scheduled_s for row in result.rows] == pytest.approx(
        [result.rows[0].scheduled_s + i / rate for i in range(n)], abs=1e-9
    )
    assert TTFT <= s["ttft_p99_s"] < TTFT + 0.03
    # served = n / (first arrival -> last completion) = n / ((n - 1) / rate + E2E)
    assert s["served_req_s"] == pytest.approx(n / ((n - 1) / rate + E2E), rel=0.05)
    assert s["send_lag_p99_s"] < 0.02


def test_open_loop_past_saturation(server):
    """Offered 3x capacity: served stays at capacity, TTFT grows with the queue, the client stays on time."""
    rate, n = 3 * CAPACITY, 24
    result = run_open_loop(server, FIXED, rate, load(n_requests=n, arrival="constant"))
    s = result.summary
    waves = n // SLOTS  # requests are served four at a time, each wave takes E2E
    assert s["served_req_s"] == pytest.approx(n / (waves * E2E), rel=0.15)
    last = max(result.rows, key=lambda row: row.index)
    # the last request waits for every wave before it, minus its own arrival offset
    assert last.ttft_s == pytest.approx((waves - 1) * E2E + TTFT - (n - 1) / rate, rel=0.15)
    assert s["ttft_p99_s"] > 2 * E2E
    assert s["send_lag_p99_s"] < 0.02  # arrivals went out on time although the server fell behind


def test_workers_split_the_schedule(server):
    result = run_closed_loop(server, FIXED, SLOTS, load(n_requests=12, workers=2))
    assert sorted(row.index for row in result.rows) == list(range(12))
    assert all(row.worker == row.index % 2 for row in result.rows)
    s = result.summary
    assert s["workers"] == 2 and s["failures"] == 0
    # looser than in-process: two more Python processes share the cores with the server
    assert TTFT <= s["ttft_p50_s"] < TTFT + 0.05
    assert s["served_req_s"] == pytest.approx(CAPACITY, rel=0.25)


def test_failures_are_kept_and_counted():
    config = FakeServerConfig(ttft_s=0.0, itl_s=0.001, fail_every=4, cut_every=5)
    with FakeServerProcess(config) as fake:
        endpoint = Endpoint(fake.base_url, "fake-model")
        result = run_closed_loop(endpoint, FIXED, 4, load(n_requests=20))
    statuses = Counter(row.status for row in result.rows)
    # arrivals 4, 8, 12, 16, 20 get HTTP 500; 5, 10, 15 are cut to half their tokens
    assert statuses == {"ok": 12, "http_500": 5, "short": 3}
    assert result.summary["failures"] == 8 and result.summary["completed"] == 12
    short = [row for row in result.rows if row.status == "short"]
    assert all(row.output_tokens == TOKENS // 2 and "10 of 20" in row.error for row in short)
    assert all("injected failure" in row.error for row in result.rows if row.status == "http_500")
    # output_tok_s counts the tokens of requests that finished well only: the cut ones streamed
    # TOKENS // 2 each, which a count over every row would add
    s = result.summary
    assert s["output_tok_s"] * s["duration_s"] == pytest.approx(12 * TOKENS)
    assert sum(row.output_tokens for row in result.rows) == 12 * TOKENS + 3 * (TOKENS // 2)


def test_unreachable_server_gives_failed_rows():
    endpoint = Endpoint("http://127.0.0.1:9/v1", "none", timeout_s=2)
    result = run_closed_loop(endpoint, FIXED, 2, load(n_requests=2))
    assert [row.status for row in result.rows] == ["connect", "connect"]
    assert result.summary["served_req_s"] == 0.0


@pytest.mark.parametrize(
    ("config", "tokens", "chunks"),
    [
        (FakeServerConfig(itl_s=0.002, tokens_per_chunk=4), TOKENS, TOKENS // 4),  # tokens from usage
        (FakeServerConfig(itl_s=0.002, send_usage=False), TOKENS, TOKENS),  # no usage: count chunks
    ],
)
def test_token_counts(config, tokens, chunks):
    with FakeServerProcess(config) as fake:
        result = run_closed_loop(Endpoint(fake.base_url, "fake-model"), FIXED, 1, load(n_requests=2))
    assert [(row.status, row.output_tokens, row.chunks) for row in result.rows] == [
        ("ok", tokens, chunks)
    ] * 2
    assert len(result.rows[0].itls_s) == chunks - 1


def test_sweep_finds_capacity():
    config = FakeServerConfig(ttft_s=0.0, itl_s=0.005, slots=4)  # 10 tokens: 0.045 s, ~89 req/s
    capacity = 4 / 0.045
    with FakeServerProcess(config) as fake:
        endpoint = Endpoint(fake.base_url, "fake-model")
        spec = WorkloadSpec(kind="fixed", input_len=8, output_len=10)
        steady = load(n_requests=24, arrival="constant")
        sweep = run_sweep(endpoint, spec, steady, SweepConfig(start_rate=30, min_ratio=1.2))
        rates = [level.summary["rate"] for level in sweep.levels]
        assert rates[:3] == [30, 60, 120]
        assert any(lv.summary["served_req_s"] < 0.9 * lv.summary["rate"] for lv in sweep.levels)
        assert sweep.capacity_req_s == pytest.approx(capacity, rel=0.2)
        assert not sweep.capacity_still_rising
        short = run_sweep(endpoint, spec, steady, SweepConfig(start_rate=20, max_levels=2))
        assert short.capacity_still_rising and len(short.levels) == 2


@pytest.mark.parametrize(
    ("capacity", "rates"),
    [
        (10.0, [1, 2, 4, 8, 16, 12]),  # 16 and 12 serve 10 < 0.9 x offered: two rates, stop
        (13.0, [1, 2, 4, 8, 16, 12, 14, 15]),  # 12 and 14 keep up (13 >= 12.6), 15 does not
        (0.5, [1, 0.5, 0.75]),  # the start is already too high: halve, then bisect
    ],
)
def test_sweep_steps(monkeypatch, capacity, rates):
    """The sweep's rate sequence against a pretend server that serves min(rate, capacity)."""
    tried = []

    def pretend(endpoint, workload, rate, load, clock_zero=None):
        tried.append(rate)
        return LevelResult({"rate": rate, "served_req_s": min(rate, capacity)}, [], [])

    monkeypatch.setattr(runner, "run_open_loop", pretend)
    result = run_sweep(Endpoint("http://unused/v1", "m"), FIXED, load(), SweepConfig(start_rate=1))
    assert tried == rates
    assert result.capacity_req_s == pytest.approx(min(max(rates), capacity))
    assert not result.capacity_still_rising


def test_stream_check_tells_streaming_from_buffered():
    async def verdict(config):
        with FakeServerProcess(config) as fake:
            endpoint = Endpoint(fake.base_url, "fake-model")
            async with make_http_client(endpoint) as http:
                return (await check_streaming(http, endpoint))["verdict"]

    assert asyncio.run(verdict(FakeServerConfig(ttft_s=0.01, itl_s=0.003))) == "streaming"
    assert asyncio.run(verdict(FakeServerConfig(ttft_s=0.01, itl_s=0.003, buffered=True))) == "buffered"


def test_monitor_sees_a_blocked_loop():
    async def blocked():
        async with ClientMonitor(interval_s=0.002) as monitor:
            for _ in range(3):
                await asyncio.sleep(0.01)
                time.sleep(0.05)  # the kind of stall that would delay every timestamp
        return monitor.result

    load_seen = asyncio.run(blocked())
    assert load_seen.loop_lag_p99_s >= 0.04
    assert load_seen.cpu_util < 0.5  # sleeping is not CPU
    assert any("loop lag" in note for note in load_seen.warnings())


def test_monitor_sees_one_stall_the_p99_hides():
    """One 80 ms stall among hundreds of quick ticks: the p99 stays small, the max and its warning do not
    (every request due in those 80 ms would have gone out late)."""

    async def one_stall():
        async with ClientMonitor(interval_s=0.002) as monitor:
            await asyncio.sleep(0.5)
            time.sleep(0.08)
            await asyncio.sleep(0.5)
        return monitor.result

    load_seen = asyncio.run(one_stall())
    assert load_seen.loop_lag_p99_s < 0.04 <= 0.07 <= load_seen.loop_stall_s
    assert any("stalled" in note for note in load_seen.warnings())
    assert ClientLoad.worst([load_seen, ClientLoad(0.0, 0.0)]).loop_stall_s == load_seen.loop_stall_s


def _collections_while(make_garbage) -> Counter:
    """How many collections of each generation the collector ran while `make_garbage` ran."""
    seen: Counter = Counter()

    def watch(phase: str, info: dict) -> None:
        if phase == "start":
            seen[info["generation"]] += 1

    gc.callbacks.append(watch)
    try:
        make_garbage()
    finally:
        gc.callbacks.remove(watch)
    return seen


def _third_threshold_counts() -> bool:
    """Whether the interpreter's collector has the third threshold (generational, to 3.13); the
    incremental one ignores it, its pauses bounded by design, and has nothing to hold off."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], 12345)
    counts = gc.get_threshold()[2] == 12345
    gc.set_threshold(*thresholds)
    return counts


@pytest.mark.skipif(
    not _third_threshold_counts(), reason="an incremental collector: no full collections to hold"
)
def test_a_level_runs_with_full_collections_held_and_collects_after():
    """bench.selfcheck.full_collections_held: long-lived objects by the hundred thousand (a level's rows
    and open streams) set off full collections, each a stall of the client's loop; held, none runs
    until the block ends, the young generations still free short-lived cycles, the one held off runs
    as the block ends, and the collector's settings come back as they were."""

    def make_garbage() -> None:
        kept = []
        for _ in range(300_000):
            cycle: list = []
            cycle.append(cycle)  # a short-lived cycle: the young generations free it
            kept.append({"row": [1.0]})  # long-lived: promoted to the oldest generation
        kept.clear()

    # A full collection runs once the objects promoted since the last one pass a quarter of those it
    # left: set aside everything the test process holds (torch and the rest, if imported), so that
    # 300,000 set one off whatever ran before this test.
    gc.collect()
    gc.freeze()
    gc.collect()
    try:
        before = gc.get_threshold()
        assert _collections_while(make_garbage)[2] >= 1  # without the hold: what the test looks for happens
        with full_collections_held():
            assert gc.get_threshold()[:2] == before[:2] and gc.get_threshold()[2] > before[2]
            held = _collections_while(make_garbage)
            assert held[2] == 0 and held[0] >= 100 and held[1] >= 10
            assert gc.get_count()[2] > before[2]  # a full collection came due while held
        assert gc.get_threshold() == before
        assert gc.get_count()[2] <= before[2]  # and ran as the block ended

        def short_level() -> None:
            with full_collections_held():
                pass

        # a level too short for one to come due: none runs before or after it (~0.1 s each over a heap
        # with torch loaded, and the tests run hundreds of short levels)
        assert _collections_while(short_level)[2] == 0
    finally:
        gc.unfreeze()

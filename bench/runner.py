"""Drive load levels: open loop at a rate, closed loop at a concurrency, and a rate sweep to capacity.

Each level builds its requests from `bench.workload`, sends them with `bench.client`, and summarises
the rows with `bench.metrics`; `--workers N` splits a level over N processes, each with a fixed share
(request i goes to worker i mod N). These functions are synchronous (they run their own event loop)
and are what the CLI and the perf tier call.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing as mp
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from tqdm import tqdm

from bench.client import Endpoint, make_http_client, send_request
from bench.metrics import (
    RequestRow,
    Slo,
    check_prompt_tokens,
    describe_failures,
    is_rejection,
    summarize,
)
from bench.selfcheck import ClientLoad, ClientMonitor, full_collections_held
from bench.workload import Arrival, Request, WorkloadSpec, arrival_offsets, make_request

T = TypeVar("T")

SEND_LAG_WARN_S = 0.010
# A closed loop that runs for a duration sends an unknown number of requests: text prompts (costly to
# make, see _prebuild) are built ahead for this many per slot, plus PREBUILD_EXTRA, before it starts.
PREBUILD_PER_SLOT = 4
PREBUILD_EXTRA = 64


@dataclass(frozen=True)
class LoadConfig:
    """How much to send per level. `duration_s`, when set, replaces `n_requests` (arrivals for that
    long, open loop; new requests for that long, closed loop). The first `warmup` requests of each
    level are sent and kept in the rows, but left out of the figures."""

    n_requests: int = 400
    duration_s: float | None = None
    warmup: int = 0
    arrival: Arrival = "poisson"
    burstiness: float = 1.0
    workers: int = 1
    slo: Slo = field(default_factory=Slo)
    progress: bool = True


@dataclass(frozen=True)
class SweepConfig:
    """Open-loop rates from `start_rate`: double while the server keeps up, then bisect between the
    highest rate that kept up and the lowest that did not; stop after two rates that did not keep
    up, after `max_levels` levels, or when the bracket is narrower than `min_ratio`.

    A level kept up when served_req_s >= `saturation` x keep_up_req_s (see keep_up_rate), the drain
    being the level's e2e p90, bounded by twice the p90 at the lowest rate that kept up (past that
    bound a level's latency holds a backlog, which would excuse it). Each level after the first lasts
    at least `latency_multiple` x the p90 at the highest rate that kept up (same bound; at most
    `max_level_s`): on levels no longer than its requests, an engine at 5-12 s a request looked
    saturated at 1 req/s while it sustained several."""

    start_rate: float = 1.0
    max_levels: int = 12
    saturation: float = 0.9
    min_ratio: float = 1.05
    latency_multiple: float = 4.0
    max_level_s: float = 120.0


@dataclass
class LevelResult:
    summary: dict[str, Any]  # flat keys, see bench.metrics.summarize, plus the level's identity
    rows: list[RequestRow]
    warnings: list[str]


@dataclass
class SweepResult:
    levels: list[LevelResult]
    capacity_req_s: float
    capacity_still_rising: bool


@dataclass(frozen=True)
class _Level:
    mode: str  # "open" or "closed"
    rate: float | None = None
    concurrency: int | None = None

    @property
    def label(self) -> str:
        return f"rate {self.rate:g}/s" if self.mode == "open" else f"concurrency {self.concurrency}"


@dataclass(frozen=True)
class _Share:
    """What one process sends: indices start, start+step, ... below stop (no stop: until the deadline)."""

    worker: int
    start: int
    step: int
    stop: int | None
    offsets: list[float] | None  # open loop: arrival offset of each of this share's requests
    slots: int  # closed loop: requests in flight in this process


def run_open_loop(
    endpoint: Endpoint,
    workload: WorkloadSpec,
    rate: float,
    load: LoadConfig = LoadConfig(),
    clock_zero: float | None = None,
) -> LevelResult:
    """Send requests at their scheduled arrival times whether or not the server keeps up."""
    offsets = arrival_offsets(
        rate,
        n=None if load.duration_s is not None else load.warmup + load.n_requests,
        duration_s=load.duration_s,
        arrival=load.arrival,
        burstiness=load.burstiness,
        seed=workload.seed,
    )
    workers = max(1, min(load.workers, len(offsets)))
    shares = [_Share(k, k, workers, len(offsets), offsets[k::workers], 0) for k in range(workers)]
    return _run_level(endpoint, workload, _Level("open", rate=rate), load, shares, None, clock_zero)


def run_closed_loop(
    endpoint: Endpoint,
    workload: WorkloadSpec,
    concurrency: int,
    load: LoadConfig = LoadConfig(),
    clock_zero: float | None = None,
) -> LevelResult:
    """Keep `concurrency` requests in flight; a new one is due the moment one finishes."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    stop = None if load.duration_s is not None else load.warmup + load.n_requests
    workers = max(1, min(load.workers, concurrency))
    shares = [
        _Share(k, k, workers, stop, None, concurrency // workers + (k < concurrency % workers))
        for k in range(workers)
    ]
    level = _Level("closed", concurrency=concurrency)
    return _run_level(endpoint, workload, level, load, shares, load.duration_s, clock_zero)


def keep_up_rate(rows: list[RequestRow], drain_s: float) -> float:
    """The served rate a server that keeps up would show at this level: the requests actually
    scheduled / (their arrival span + drain_s), drain_s being how long the last arrivals take when
    the server keeps up.

    served_req_s counts from the first arrival to the last completion, so even an idle server
    scores below the nominal rate on a short level (the last requests' latency, and the Poisson
    draw of how many arrivals fell in the window). The sweep compares served_req_s with this
    instead, so a level is saturated only when completions fall behind arrivals.
    """
    measured = [row for row in rows if not row.warmup]
    if len(measured) < 2 or not math.isfinite(drain_s):
        return math.nan
    span = max(row.scheduled_s for row in measured) - min(row.scheduled_s for row in measured)
    return len(measured) / (span + drain_s)


def _level_load(load: LoadConfig, sweep: SweepConfig, rate: float, latency_s: float | None) -> LoadConfig:
    """The load of the next level, stretched to `latency_multiple` x the latency it will see."""
    if latency_s is None or not math.isfinite(latency_s):
        return load
    wanted_s = min(sweep.latency_multiple * latency_s, sweep.max_level_s)
    if load.duration_s is not None:
        return replace(load, duration_s=max(load.duration_s, wanted_s))
    return replace(load, n_requests=max(load.n_requests, math.ceil(rate * wanted_s)))


def run_sweep(
    endpoint: Endpoint,
    workload: WorkloadSpec,
    load: LoadConfig = LoadConfig(),
    sweep: SweepConfig = SweepConfig(),
    clock_zero: float | None = None,
) -> SweepResult:
    """Raise the open-loop rate until the server stops keeping up (see SweepConfig): a level kept up
    when served_req_s >= saturation x keep_up_req_s (see keep_up_rate).

    capacity_req_s = the highest served_req_s of any level (a saturated server works flat out from
    the first arrival to the last completion, so there served_req_s is its sustained rate);
    capacity_still_rising = the highest rate tried still kept up, so capacity may be higher.
    Example: 1, 2, 4, 8 kept up, 16 did not -> 12 (kept up) -> 14 (did not): stop; two rates failed.
    """
    levels: list[LevelResult] = []
    kept_up: dict[float, bool] = {}
    latency_kept_up: dict[float, float] = {}  # rate -> e2e p90 at the rates that kept up
    rate = sweep.start_rate
    for _ in range(sweep.max_levels):
        # A server that keeps up takes at most twice its latency at the lowest rate it kept up with;
        # past that, a level's latency holds a backlog and would excuse it (and stretch it).
        bound = 2.0 * latency_kept_up[min(latency_kept_up)] if latency_kept_up else math.inf
        below = [r for r in latency_kept_up if r < rate]
        reference = min(latency_kept_up[max(below)], bound) if below else None
        level_load = _level_load(load, sweep, rate, reference)
        result = run_open_loop(endpoint, workload, rate, level_load, clock_zero)
        levels.append(result)
        summary = result.summary
        own_p90 = summary.get("e2e_p90_s", math.nan)
        drain = min(own_p90, bound)  # how long its last arrivals take if the server keeps up
        keep_up = keep_up_rate(result.rows, drain)
        summary["keep_up_req_s"] = keep_up
        keep_up = rate if not math.isfinite(keep_up) else keep_up
        kept_up[rate] = summary["served_req_s"] >= sweep.saturation * keep_up
        summary["kept_up"] = kept_up[rate]
        if kept_up[rate] and math.isfinite(own_p90):
            latency_kept_up[rate] = own_p90
        passed = [r for r, ok in kept_up.items() if ok]
        failed = [r for r, ok in kept_up.items() if not ok]
        if len(failed) >= 2:
            break
        if not failed:
            rate *= 2
            continue
        high = min(failed)
        low = max((r for r in passed if r < high), default=None)
        if low is None:
            rate = high / 2
        elif high / low < sweep.min_ratio:
            break
        else:
            rate = (low + high) / 2
    capacity = max((level.summary["served_req_s"] for level in levels), default=0.0)
    return SweepResult(levels, capacity, kept_up[max(kept_up)])


def sweep_failures(result: SweepResult) -> tuple[list[str], list[str]]:
    """(failed, turned away): one line per error kind and level, led by the level's rate.

    Past saturation a server with admission control turns requests away (429/503) instead of
    queueing without bound; at a level it did not keep up with that is by design ("turned away"),
    at a level it kept up with, and for any other error, it is a failure."""
    failed: list[str] = []
    turned_away: list[str] = []
    for level in result.levels:
        shedding = not level.summary["kept_up"]
        rejected = [row for row in level.rows if shedding and is_rejection(row)]
        others = [row for row in level.rows if not (shedding and is_rejection(row))]
        rate = f"rate {level.summary['rate']:g}/s"
        failed.extend(f"{rate}: {line}" for line in describe_failures(others))
        turned_away.extend(f"{rate}, past saturation: {line}" for line in describe_failures(rejected))
    return failed, turned_away


def _run_level(
    endpoint: Endpoint,
    workload: WorkloadSpec,
    level: _Level,
    load: LoadConfig,
    shares: list[_Share],
    deadline_s: float | None,
    clock_zero: float | None,
) -> LevelResult:
    total = shares[0].stop
    bar = tqdm(
        total=total,
        desc=f"{endpoint.target or endpoint.model} {level.label}",
        unit="req",
        disable=not load.progress or not sys.stderr.isatty(),
        file=sys.stderr,
    )
    with bar:
        if len(shares) == 1:

            async def start_now() -> tuple[float, float]:
                now = time.monotonic()
                return (now if clock_zero is None else clock_zero), now

            rows, client_load = _run_client(
                _drive(endpoint, workload, level, load.warmup, shares[0], deadline_s, bar.update, start_now)
            )
            loads = [client_load]
        else:
            rows, loads = _run_in_workers(
                endpoint, workload, level, load, shares, deadline_s, clock_zero, bar
            )
    rows.sort(key=lambda row: row.index)
    worst = ClientLoad.worst(loads)
    summary: dict[str, Any] = {
        "mode": level.mode,
        "rate": level.rate,
        "concurrency": level.concurrency,
        "offered_req_s": level.rate,
        "workers": len(shares),
        **summarize(rows, load.slo),
        "client_loop_lag_p99_s": worst.loop_lag_p99_s,
        "client_loop_stall_s": worst.loop_stall_s,
        "client_cpu_util": worst.cpu_util,
    }
    notes = worst.warnings()
    if workload.exact_prompt_lens:
        summary.update(check_prompt_tokens(rows))
        if summary["prompt_tokens_outside_tolerance"]:
            notes.append(
                f"the server counted {summary['prompt_tokens_outside_tolerance']} of "
                f"{summary['prompt_tokens_checked']} prompts outside tolerance of their length (largest "
                f"difference {summary['prompt_tokens_off_max']:+d} tokens): the prompts are not what the "
                "workload says"
            )
    if summary["send_lag_p99_s"] > SEND_LAG_WARN_S:
        notes.append(f"send lag p99 {summary['send_lag_p99_s'] * 1e3:.1f} ms: requests went out late")
    notes = [f"{level.label}: {note}" for note in notes]
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    return LevelResult(summary, rows, notes)


def _run_client(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run for a level's client, quiet about interrupts and safe from them.

    Ctrl-C: asyncio.Runner cancels the client's task and raises KeyboardInterrupt once the loop has
    stopped. SIGTERM, where the process has a Python handler for it (the perf tier's
    bench.launch.stop_servers_on_sigterm raises KeyboardInterrupt): the same, the handler called once
    the loop has stopped. Left to itself, that handler would raise wherever the main thread stood,
    perhaps inside the executor's submit while it holds the executor's lock (aiohttp hands each
    request's proxy and netrc lookups to threads), and the loop's shutdown would then wait on that lock
    for ever: a run that hangs after SIGTERM instead of ending. A second SIGTERM while the client winds
    down ends the process at once.

    A task still holding the interrupt when collected (the client awaiting a request's writer on its
    way out) would be reported as "Task exception was never retrieved", a traceback that reads like a
    crash after the run's own summary: the loop's exception handler leaves those out."""
    with asyncio.Runner() as runner:
        loop = runner.get_loop()
        loop.set_exception_handler(_ignore_interrupts)
        handler = signal.getsignal(signal.SIGTERM)
        if not callable(handler) or threading.current_thread() is not threading.main_thread():
            return runner.run(main)
        signalled = False

        def on_sigterm() -> None:
            nonlocal signalled
            signalled = True
            loop.remove_signal_handler(signal.SIGTERM)  # back to the default: a second one ends it
            for task in asyncio.all_tasks(loop):
                if task.get_coro() is main:
                    task.cancel()

        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
        try:
            return runner.run(main)
        finally:
            if not signalled:
                loop.remove_signal_handler(signal.SIGTERM)
            signal.signal(signal.SIGTERM, handler)
            if signalled:
                handler(signal.SIGTERM, None)  # the process's own reaction, now at a safe point


def _ignore_interrupts(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    if not isinstance(context.get("exception"), KeyboardInterrupt | SystemExit):
        loop.default_exception_handler(context)


async def _drive(
    endpoint: Endpoint,
    workload: WorkloadSpec,
    level: _Level,
    warmup: int,
    share: _Share,
    deadline_s: float | None,
    on_done: Callable[[int], object],
    start_signal: Callable[[], Awaitable[tuple[float, float]]],
) -> tuple[list[RequestRow], ClientLoad]:
    """Send one process's share of a level.

    Everything slow to set up (the HTTP client) is built first; then `start_signal` gives
    (clock_zero, level_start) as monotonic times, so no process starts late because of its own set-up.
    Open loop: each request goes out at level_start + its offset. Closed loop: `share.slots` loops,
    each sending its next request the moment its last one finished (that moment is its scheduled time).
    """
    rows: list[RequestRow] = []
    indices: Iterator[int] = itertools.count(share.start, share.step)
    if share.stop is not None:
        indices = iter(range(share.start, share.stop, share.step))

    make_request(workload, share.start)  # first call pays for lazy set-up (dataset file, numpy); not timed
    _prebuild(workload, share)
    with full_collections_held():  # no full collection stalls the loop mid-level (bench.selfcheck)
        async with make_http_client(endpoint) as http:
            clock_zero, start = await start_signal()

            async def send(request: Request, due: float) -> None:
                row = RequestRow(
                    endpoint.target, level.mode, level.rate, level.concurrency, workload.seed, request.index,
                    request.index < warmup, request.prompt_len, request.max_tokens, due - clock_zero, math.nan,
                    worker=share.worker,
                )  # fmt: skip
                rows.append(row)
                await send_request(http, endpoint, request, row, clock_zero)
                on_done(1)

            async def slot() -> None:
                for index in indices:
                    due = time.monotonic()
                    if deadline_s is not None and due - start >= deadline_s:
                        return
                    await send(make_request(workload, index), due)

            async with ClientMonitor() as monitor:
                await asyncio.sleep(max(0.0, start - time.monotonic()))
                if share.offsets is not None:
                    tasks = []
                    for index, offset in zip(indices, share.offsets, strict=False):
                        # built before its time, so it cannot delay it
                        request = make_request(workload, index)
                        due = start + offset
                        await asyncio.sleep(max(0.0, due - time.monotonic()))
                        tasks.append(asyncio.create_task(send(request, due)))
                    await asyncio.gather(*tasks)
                else:
                    await asyncio.gather(*(slot() for _ in range(share.slots)))
        assert monitor.result is not None
        return rows, monitor.result


def _prebuild(workload: WorkloadSpec, share: _Share) -> None:
    """Make a share's text prompts before its level starts (make_request keeps them), so their
    decoding and re-encoding (milliseconds each) is neither in a TTFT nor on the event loop while
    streams are read. Token-id prompts cost microseconds and are made as they are sent."""
    if not workload.sends_text or workload.kind == "jsonl":
        return
    stop = share.stop
    if stop is None:  # a closed loop for a duration: enough for most levels, the rest made as sent
        stop = share.start + share.step * (PREBUILD_PER_SLOT * share.slots + PREBUILD_EXTRA)
    for index in range(share.start, stop, share.step):
        make_request(workload, index)


def _run_in_workers(
    endpoint: Endpoint,
    workload: WorkloadSpec,
    level: _Level,
    load: LoadConfig,
    shares: list[_Share],
    deadline_s: float | None,
    clock_zero: float | None,
    bar: tqdm,
) -> tuple[list[RequestRow], list[ClientLoad]]:
    """Start one process per share, wait until all are ready, give them one start time, merge rows.

    time.monotonic() is one system-wide clock on Linux and macOS, so times from all processes agree.
    """
    ctx = mp.get_context("spawn")  # not fork: the parent may hold threads (progress bar, test servers)
    ready = ctx.Queue()
    results = ctx.Queue()
    go = ctx.Event()
    start_at = ctx.Value("d", 0.0)
    done = ctx.Value("i", 0)
    zero = ctx.Value("d", clock_zero if clock_zero is not None else 0.0)
    processes = [
        ctx.Process(
            target=_worker_main,
            args=(
                endpoint,
                workload,
                level,
                load.warmup,
                share,
                deadline_s,
                zero,
                start_at,
                go,
                ready,
                results,
                done,
            ),
            daemon=True,
        )
        for share in shares
    ]
    for process in processes:
        process.start()
    for _ in processes:
        ready.get(timeout=120)
    start = time.monotonic() + 0.05  # every worker is waiting on `go`; they all start at this instant
    start_at.value = start
    if clock_zero is None:
        zero.value = start
    go.set()
    rows: list[RequestRow] = []
    loads: list[ClientLoad] = []
    received = 0
    while received < len(processes):
        try:
            worker_rows, worker_load, error = results.get(timeout=0.2)
        except Exception:  # queue.Empty: update the bar, check the workers are alive
            bar.update(done.value - bar.n)
            if not any(p.is_alive() for p in processes) and results.empty():
                raise RuntimeError("a bench worker process died without a result") from None
            continue
        if error:
            raise RuntimeError(f"bench worker failed: {error}")
        rows.extend(worker_rows)
        loads.append(worker_load)
        received += 1
    bar.update(done.value - bar.n)
    for process in processes:
        process.join(timeout=10)
    return rows, loads


def _worker_main(
    endpoint, workload, level, warmup, share, deadline_s, zero, start_at, go, ready, results, done
):  # type: ignore[no-untyped-def]
    def count(n: int) -> None:
        with done.get_lock():
            done.value += n

    async def wait_for_go() -> tuple[float, float]:
        ready.put(share.worker)
        await asyncio.to_thread(go.wait)
        return zero.value, start_at.value

    try:
        rows, load = _run_client(
            _drive(endpoint, workload, level, warmup, share, deadline_s, count, wait_for_go)
        )
        results.put((rows, load, None))
    except BaseException as exc:  # reported to the parent, which raises
        results.put(([], None, repr(exc)))

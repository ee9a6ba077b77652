"""The client watching itself: event-loop lag and process CPU use during a level, and keeping its
loop on time.

The runner starts a `ClientMonitor` around each level in every client process; if the loop oversleeps
or the process is near a full core, the timestamps it took may be late, and the run says so. Each
level runs with the garbage collector's full collections held off (`full_collections_held`): with a
thousand streams waiting on a saturated server, one full collection stalls the loop for tens to
hundreds of milliseconds, and every request due in that time goes out late.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass

from bench.metrics import percentile

LOOP_LAG_WARN_S = 0.010
LOOP_STALL_WARN_S = 0.050
CPU_UTIL_WARN = 0.9
# The third generation's threshold while a level runs: never reached (a full collection runs once
# this many second-generation collections have passed).
HELD_FULL_THRESHOLD = 1 << 30


@dataclass(frozen=True)
class ClientLoad:
    """loop_lag_p99_s: p99 of how much a short sleep overslept; loop_stall_s: the longest oversleep
    (one stall, rare enough for the p99 to hide, still makes every request due in it late);
    cpu_util: CPU seconds / wall seconds."""

    loop_lag_p99_s: float
    cpu_util: float
    loop_stall_s: float = 0.0

    def warnings(self) -> list[str]:
        notes = []
        if self.loop_lag_p99_s > LOOP_LAG_WARN_S:
            notes.append(
                f"client event-loop lag p99 {self.loop_lag_p99_s * 1e3:.1f} ms > {LOOP_LAG_WARN_S * 1e3:.0f} ms:"
                " timestamps may be late; try --workers"
            )
        if self.loop_stall_s > LOOP_STALL_WARN_S:
            notes.append(
                f"client event loop stalled {self.loop_stall_s * 1e3:.0f} ms at worst"
                f" (> {LOOP_STALL_WARN_S * 1e3:.0f} ms): requests due then went out late"
            )
        if self.cpu_util > CPU_UTIL_WARN:
            notes.append(
                f"client CPU use {self.cpu_util:.0%} of a core > {CPU_UTIL_WARN:.0%}:"
                " the client may be the bottleneck; try --workers"
            )
        return notes

    @staticmethod
    def worst(loads: list[ClientLoad]) -> ClientLoad:
        """Across worker processes, the busiest one speaks for the run."""
        return ClientLoad(
            max(x.loop_lag_p99_s for x in loads),
            max(x.cpu_util for x in loads),
            max(x.loop_stall_s for x in loads),
        )


class ClientMonitor:
    """Async context manager: a ticker coroutine sleeps `interval_s` repeatedly and records the oversleep."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self._task: asyncio.Task[None] | None = None
        self._wall0 = self._cpu0 = 0.0
        self.result: ClientLoad | None = None

    async def _tick(self) -> None:
        while True:
            before = time.monotonic()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.monotonic() - before - self.interval_s))

    async def __aenter__(self) -> ClientMonitor:
        self._wall0, self._cpu0 = time.monotonic(), time.process_time()
        self._task = asyncio.create_task(self._tick())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        wall = time.monotonic() - self._wall0
        cpu = time.process_time() - self._cpu0
        lag = percentile(self.lags, 99) if self.lags else 0.0
        self.result = ClientLoad(
            loop_lag_p99_s=lag,
            cpu_util=cpu / wall if wall > 0 else 0.0,
            loop_stall_s=max(self.lags, default=0.0),
        )


@contextlib.contextmanager
def full_collections_held() -> Iterator[None]:
    """Hold off the collector's full (third-generation) collections until the block ends; run the
    one it held off, if one came due, after it.

    A full collection walks every tracked object: with a level's rows and a thousand open streams,
    50-125 ms on a 2-core host (and send lags of 200-300 ms on a GPU host's saturated levels), during
    which the loop neither sends nor stamps. The young generations still run (a few ms each) and free
    the per-request cycles that die young; what lives longer waits for the collection at the end,
    memory a level can spare. No collection before the level or after a short one: each costs ~0.1 s
    over a heap with torch loaded, and the tests run hundreds of short levels. An incremental collector
    (one that ignores the third threshold) bounds its pauses itself: there the hold changes nothing."""
    thresholds = gc.get_threshold()
    gc.set_threshold(thresholds[0], thresholds[1], HELD_FULL_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        if gc.get_count()[2] > thresholds[2]:  # second-generation collections since the last full one
            gc.collect()

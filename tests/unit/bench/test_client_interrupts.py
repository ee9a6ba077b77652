"""A level's client interrupted mid-run (Ctrl-C, or SIGTERM where the perf tier turns it into one)
ends once, through the callers' `finally` blocks, and says nothing more at exit.

The interrupt raises in whichever task runs at that moment. A task left holding it (the client
awaiting a request's writer on its way out) used to be reported when collected: "Task exception was
never retrieved" with a traceback, printed after the perf tier's own summary, which read like a crash
(test_perf_gate's SIGTERM case failed on it about one run in four). Other exceptions a task leaves
unretrieved are still reported.

SIGTERM with a Python handler (the perf tier's) no longer raises inside the loop: it cancels the
client, and the handler runs once the loop has stopped (the last two tests).
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from bench.runner import _run_client


async def _left_holding(exception: BaseException) -> None:
    """A side task raises; the main task, already leaving, awaits it in its `finally` and so ends with
    the same exception (as an HTTP client awaiting a request's writer does)."""

    async def side() -> None:
        await asyncio.sleep(0.01)
        raise exception

    task = asyncio.ensure_future(side())
    try:
        await asyncio.sleep(10)
    finally:
        await task


def _reported(capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture) -> str:
    """What asyncio said about tasks at collection: its logger's records, and stderr."""
    gc.collect()
    return caplog.text + capfd.readouterr().err


def test_an_interrupt_is_raised_once_and_not_reported_again(capfd, caplog):
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        _run_client(_left_holding(KeyboardInterrupt("SIGTERM")))
    assert "never retrieved" not in _reported(capfd, caplog)


def test_other_exceptions_left_in_tasks_are_still_reported(capfd, caplog):
    async def main() -> None:
        async def fails() -> None:
            raise ValueError("lost")

        asyncio.ensure_future(fails())  # never awaited: its exception is never retrieved
        await asyncio.sleep(0.01)

    _run_client(main())
    assert "never retrieved" in _reported(capfd, caplog)


def test_the_client_coroutine_result_comes_back():
    async def main() -> tuple[int, str]:
        await asyncio.sleep(0)
        return 3, "rows"

    assert _run_client(main()) == (3, "rows")


def _on_sigterm_record(calls: list[bool]) -> Callable[[int, object], None]:
    """A process's SIGTERM handler, as the perf tier's: raises KeyboardInterrupt; records whether an
    event loop was running where it was called."""

    def handler(signum: int, frame: object) -> None:
        calls.append(asyncio._get_running_loop() is not None)
        raise KeyboardInterrupt("SIGTERM")

    return handler


@pytest.fixture
def sigterm_handler() -> Iterator[list[bool]]:
    """Installs _on_sigterm_record's handler for the test (which runs in the main thread, where
    signals land) and puts the process's own back after it."""
    if threading.current_thread() is not threading.main_thread():
        pytest.fail("signal handlers can only be set from the main thread")
    calls: list[bool] = []
    previous = signal.signal(signal.SIGTERM, _on_sigterm_record(calls))
    try:
        yield calls
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_sigterm_cancels_the_client_and_calls_the_handler_outside_the_loop(sigterm_handler):
    """The handler raises once the client's `finally` blocks ran and the loop stopped, not wherever
    the main thread stood: raised inside the executor's submit (aiohttp's per-request lookups run in
    threads) it left the executor's lock held, and the loop's shutdown waited on it for ever (a client
    hopping to a thread each request hung in 3 of 200 SIGTERMs; test_perf_gate's SIGTERM case once)."""
    cleaned_up = []

    async def main() -> None:
        try:
            await asyncio.to_thread(os.kill, os.getpid(), signal.SIGTERM)
            await asyncio.sleep(10)
        finally:
            await asyncio.to_thread(time.sleep, 0.01)  # the executor still works while winding down
            cleaned_up.append(True)

    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        _run_client(main())
    assert time.monotonic() - started < 5
    assert cleaned_up == [True]
    assert sigterm_handler == [False]  # called once, with no loop running


def test_the_sigterm_handler_is_the_processs_own_again_after_a_run(sigterm_handler):
    handler = signal.getsignal(signal.SIGTERM)

    async def main() -> int:
        assert signal.getsignal(signal.SIGTERM) is not handler  # the loop's own while the client runs
        return 7

    assert _run_client(main()) == 7
    assert signal.getsignal(signal.SIGTERM) is handler
    assert sigterm_handler == []

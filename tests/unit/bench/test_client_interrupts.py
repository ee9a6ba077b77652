"""A level's client interrupted mid-run (Ctrl-C, or SIGTERM where the perf tier turns it into one)
ends once, through the callers' `finally` blocks, and says nothing more at exit.

The interrupt raises in whichever task runs at that moment. A task left holding it (the client
awaiting a request's writer on its way out) used to be reported when collected: "Task exception was
never retrieved" with a traceback, printed after the perf tier's own summary, which read like a crash
(test_perf_gate's SIGTERM case failed on it about one run in four). Other exceptions a task leaves
unretrieved are still reported.
"""

from __future__ import annotations

import asyncio
import gc

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

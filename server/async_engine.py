"""The engine loop in its own thread, and the asyncio-side handle the HTTP handlers talk to.

Handlers call `AsyncEngine.add` (admission control, then an "add" command on a queue) and read the
returned `RequestStream`. The loop thread owns the LLMEngine: it takes commands between steps, steps,
and hands each step's outputs back to the event loop in one `call_soon_threadsafe` call.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from engine import EngineStats, InvalidRequestError, LLMEngine, RequestOutput, SamplingParams

logger = logging.getLogger(__name__)


class EngineLoopError(RuntimeError):
    """A request failed inside the engine loop (not the client's fault): answered as a 500."""


class AdmissionError(RuntimeError):
    """The server cannot take this request now (too many pending, or shutting down): a 503."""


class LoopObserver(Protocol):
    """What the loop reports to, from its own thread (metrics.ServerMetrics implements it)."""

    def on_request_added(self, num_prompt_tokens: int) -> None: ...

    def on_step(self, step_seconds: float, num_new_tokens: int) -> None: ...

    def on_first_token(self, seconds_since_arrival: float) -> None: ...

    def on_request_finished(self, finish_reason: str, seconds_since_arrival: float) -> None: ...

    def on_stats(self, stats: EngineStats, num_preemptions: int) -> None: ...


# -- commands, from the event loop to the engine thread ---------------------------------------
@dataclass(frozen=True)
class _Add:
    request_id: str
    token_ids: list[int]
    params: SamplingParams
    stream: RequestStream
    index: int
    arrival_time: float


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _AbortAll:
    pass


@dataclass(frozen=True)
class _Stop:
    pass


@dataclass(frozen=True)
class _ResetPrefixCache:
    done: concurrent.futures.Future[int]  # the number of cached blocks freed


_Command = _Add | _Abort | _AbortAll | _Stop | _ResetPrefixCache
# What the thread hands back per request: an output (its last one has finished=True) or an error.
_Delivery = tuple["RequestStream", int, RequestOutput | Exception]


@dataclass
class _InFlight:
    stream: RequestStream
    index: int
    arrival_time: float
    seen_first_token: bool = False


class RequestStream:
    """The outputs of the k engine requests behind one HTTP request (k > 1 for a batch prompt).

    Iterate it for (index, RequestOutput) pairs until every request has finished; an engine failure is
    raised from the iteration. `abort` (idempotent) ends whatever is still running.

    An output that arrives while the previous one of the same request is still unread joins it (both
    deltas, the later totals), as vLLM's output collector does: a server that falls behind the engine
    sends fewer, larger chunks instead of falling further behind.
    """

    def __init__(self, owner: AsyncEngine, request_ids: list[str]) -> None:
        self.request_ids = request_ids
        self._owner = owner
        self._items: deque[tuple[int, RequestOutput | Exception]] = deque()
        self._ready = asyncio.Event()
        self._unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, index: int, item: RequestOutput | Exception) -> bool:
        """Called on the event loop; True when this was index's final item."""
        items = self._items
        unread = items[-1] if items else None
        if (
            unread is not None
            and unread[0] == index
            and isinstance(unread[1], RequestOutput)
            and not unread[1].finished
            and isinstance(item, RequestOutput)
        ):
            items[-1] = (index, unread[1].followed_by(item))
        else:
            items.append((index, item))
        self._ready.set()
        if isinstance(item, Exception) or item.finished:
            self._unfinished.discard(index)
            return True
        return False

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self.request_ids)
        items = self._items
        while remaining:
            while not items:
                self._ready.clear()
                await self._ready.wait()
            index, item = items.popleft()
            if isinstance(item, Exception):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item

    def abort(self) -> None:
        for index in list(self._unfinished):
            self._owner._commands.put(_Abort(self.request_ids[index]))


@dataclass(frozen=True)
class Snapshot:
    """What the loop thread publishes after each step for /metrics (replaced whole, never mutated)."""

    stats: EngineStats
    num_preemptions: int = 0


class AsyncEngine:
    """Owns the engine thread; every public method runs on the event loop."""

    def __init__(
        self, engine: LLMEngine, max_pending: int | None = None, observer: LoopObserver | None = None
    ) -> None:
        self.engine = engine
        # Default: twice the sequences one step runs, so a full batch can wait behind the running one.
        self.max_pending = max_pending if max_pending is not None else 2 * engine.max_num_seqs
        self.observer = observer
        self.accepting = True
        self.snapshot = Snapshot(engine.stats(), engine.scheduler.num_preemptions)
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._num_pending = 0
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle (event loop) ------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()  # bound to this loop
        self._idle.set()
        self.accepting = True
        self._publish()  # /metrics holds the engine's figures from the start, not from its first step
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_pending(self) -> int:
        return self._num_pending

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give the accepted ones `timeout` seconds, then abort the rest."""
        self.accepting = False
        if self._num_pending:
            logger.info("draining: waiting up to %.1fs for %d request(s)", timeout, self._num_pending)
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                logger.warning("drain timeout: aborting %d request(s)", self._num_pending)
                self._commands.put(_AbortAll())
                try:
                    await asyncio.wait_for(self._idle.wait(), 5.0)
                except TimeoutError:
                    logger.error("engine loop did not abort %d request(s) in time", self._num_pending)
        logger.info("drained")

    async def stop(self) -> None:
        """Stop the thread (aborting anything left); the LLMEngine can be driven again afterwards."""
        self.accepting = False
        if self._thread is None:
            return
        self._commands.put(_Stop())
        await asyncio.to_thread(self._thread.join, 10.0)
        self._thread = None

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefix blocks, between two steps; returns how many were freed.
        Raises AdmissionError when the engine loop is not running."""
        if not self.is_alive:
            raise AdmissionError("the engine loop is not running")
        done: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._commands.put(_ResetPrefixCache(done))
        return await asyncio.wrap_future(done)

    # -- requests (event loop) -------------------------------------------------------------------
    def add(self, request_id: str, prompts: list[list[int]], params: SamplingParams) -> RequestStream:
        """Admit and queue len(prompts) engine requests (already validated); raises AdmissionError."""
        self.check_admission(len(prompts))
        request_ids = (
            [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        stream = RequestStream(self, request_ids)
        self._num_pending += len(prompts)
        self._idle.clear()
        now = time.monotonic()
        for index, token_ids in enumerate(prompts):
            self._commands.put(_Add(request_ids[index], token_ids, params, stream, index, now))
        return stream

    def check_admission(self, count: int) -> None:
        """Raise AdmissionError unless `count` more requests fit under max_pending right now, and
        InvalidRequestError (a 400) for a batch that could never fit, even on an idle server."""
        if count > self.max_pending:
            raise InvalidRequestError(
                f"a batch of {count} prompts is more than the server ever accepts at once ({self.max_pending}, --max-pending)",
                "prompt",
            )
        if not self.accepting:
            raise AdmissionError("the server is shutting down")
        if not self.is_alive:
            raise AdmissionError("the engine loop is not running")
        if self._num_pending + count > self.max_pending:
            raise AdmissionError(
                f"too many pending requests ({self._num_pending} accepted, at most {self.max_pending}); retry later"
            )

    def _deliver(self, deliveries: list[_Delivery]) -> None:
        """Runs on the event loop: route one step's outputs to their streams."""
        for stream, index, item in deliveries:
            if stream._put(index, item):
                self._num_pending -= 1
        if self._num_pending == 0:
            self._idle.set()

    # -- the loop (engine thread) ----------------------------------------------------------------
    def _run(self) -> None:
        in_flight: dict[str, _InFlight] = {}
        try:
            self._loop_forever(in_flight)
        except BaseException:
            logger.exception("engine loop died")
            raise
        finally:
            # Whatever is still accepted (in the engine or still queued) gets an answer.
            deliveries: list[_Delivery] = []
            self._fail_all(in_flight, "the server stopped before the request finished", deliveries)
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    deliveries.append((command.stream, command.index, EngineLoopError("the server stopped")))
                elif isinstance(command, _ResetPrefixCache):
                    command.done.set_exception(EngineLoopError("the server stopped"))
            self._publish()
            self._send(deliveries)

    def _loop_forever(self, in_flight: dict[str, _InFlight]) -> None:
        engine = self.engine
        while True:
            deliveries: list[_Delivery] = []
            # Block only when there is nothing to step: an idle server costs no CPU.
            commands = self._take_commands(block=not engine.has_unfinished_requests())
            for command in commands:
                if isinstance(command, _Stop):
                    return
                self._apply(command, in_flight, deliveries)
            if engine.has_unfinished_requests():
                self._step(in_flight, deliveries)
            self._publish()
            if deliveries:
                self._send(deliveries)

    def _take_commands(self, block: bool) -> list[_Command]:
        commands: list[_Command] = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, command: _Command, in_flight: dict[str, _InFlight], deliveries: list[_Delivery]) -> None:
        if isinstance(command, _Add):
            try:
                self.engine.add_request(
                    command.request_id, command.token_ids, command.params, command.arrival_time
                )
            except Exception as error:  # a bad request fails alone; the loop goes on
                if not isinstance(error, InvalidRequestError):
                    logger.exception("add_request failed for %s", command.request_id)
                    error = EngineLoopError(f"the engine could not take the request: {type(error).__name__}")
                deliveries.append((command.stream, command.index, error))
                return
            in_flight[command.request_id] = _InFlight(command.stream, command.index, command.arrival_time)
            if self.observer:
                self.observer.on_request_added(len(command.token_ids))
        elif isinstance(command, _Abort):
            self._abort(command.request_id, in_flight, deliveries)
        elif isinstance(command, _AbortAll):
            for request_id in list(in_flight):
                self._abort(request_id, in_flight, deliveries)
        elif isinstance(command, _ResetPrefixCache):
            try:
                freed = self.engine.reset_prefix_cache()
                self._publish()  # the gauges say so before the caller hears it is done
                command.done.set_result(freed)
            except Exception as error:
                logger.exception("resetting the prefix cache failed")
                command.done.set_exception(EngineLoopError(f"reset failed: {type(error).__name__}"))

    def _abort(self, request_id: str, in_flight: dict[str, _InFlight], deliveries: list[_Delivery]) -> None:
        entry = in_flight.pop(request_id, None)
        if entry is None:  # finished already; its last output is on its way
            return
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort failed for %s", request_id)
        aborted = RequestOutput(
            request_id,
            prompt_token_ids=[],
            new_token_ids=[],
            text="",
            new_text="",
            finished=True,
            finish_reason="abort",
        )
        deliveries.append((entry.stream, entry.index, aborted))
        if self.observer:
            self.observer.on_request_finished("abort", time.monotonic() - entry.arrival_time)

    def _step(self, in_flight: dict[str, _InFlight], deliveries: list[_Delivery]) -> None:
        start = time.perf_counter()
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine's state after a failed step is unknown: fail everything in it, keep serving.
            logger.exception("engine step failed; failing %d request(s)", len(in_flight))
            self._fail_all(in_flight, "the engine failed while generating", deliveries)
            return
        now = time.monotonic()
        num_new_tokens = 0
        for output in outputs:
            entry = in_flight.get(output.request_id)
            if entry is None:
                continue
            num_new_tokens += len(output.new_token_ids)
            deliveries.append((entry.stream, entry.index, output))
            observer = self.observer
            if observer and not entry.seen_first_token:
                entry.seen_first_token = True
                observer.on_first_token(now - entry.arrival_time)
            if output.finished:
                del in_flight[output.request_id]
                if observer:
                    observer.on_request_finished(output.finish_reason or "stop", now - entry.arrival_time)
        if self.observer:
            self.observer.on_step(time.perf_counter() - start, num_new_tokens)

    def _fail_all(self, in_flight: dict[str, _InFlight], message: str, deliveries: list[_Delivery]) -> None:
        for request_id, entry in in_flight.items():
            try:
                self.engine.abort(request_id)
            except Exception:
                logger.exception("abort failed for %s", request_id)
            deliveries.append((entry.stream, entry.index, EngineLoopError(message)))
        in_flight.clear()

    def _publish(self) -> None:
        try:
            stats = self.engine.stats()
            preemptions = self.engine.scheduler.num_preemptions
        except Exception:
            logger.exception("reading engine stats failed")
            return
        self.snapshot = Snapshot(stats, preemptions)
        if self.observer:
            self.observer.on_stats(stats, preemptions)

    def _send(self, deliveries: list[_Delivery]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the event loop closed since the check
            loop.call_soon_threadsafe(self._deliver, deliveries)

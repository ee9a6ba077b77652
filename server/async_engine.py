"""The API process's handle on the engine core: admission, requests out, outputs and text back in.

The engine core runs in its own process (engine/core_process.py) and sends bare token ids; this
module, on the API process's event loop, owns one DEALER socket to it. `AsyncEngine.add` admits and
sends a request and returns a `RequestStream`; a receiver task decodes the core's `StepOutputs`,
turns token ids into text and applies stop strings (`OutputProcessor`, as the offline engine does),
and routes each output to its stream. A stop string found here aborts the request in the core; an
abort (disconnect, drain) ends the stream at once and tells the core. If the core process dies, every
request still running fails with an error and `on_core_lost` is called.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import zmq
import zmq.asyncio

from engine import InvalidRequestError, RequestOutput, SamplingParams
from engine.core_messages import (
    OUTPUT_DECODER,
    AbortRequests,
    AddRequest,
    CallResult,
    CoreRequest,
    CoreStats,
    Goodbye,
    Hello,
    ResetPrefixCache,
    StepOutputs,
    over_the_limit,
)
from engine.core_process import CoreHandle, without_high_water_marks
from engine.output_processor import OutputProcessor, ended_by_text

logger = logging.getLogger(__name__)

GOODBYE_LINGER_MS = 1000  # how long a closing API process gives its last messages to reach the core


class EngineLoopError(RuntimeError):
    """A request failed inside the engine (not the client's fault): answered as a 500."""


class AdmissionError(RuntimeError):
    """The server cannot take this request now (too many pending, or shutting down): a 503."""


class LoopObserver(Protocol):
    """What the engine's outputs are reported to (metrics.ServerMetrics implements it)."""

    def on_request_added(self, num_prompt_tokens: int) -> None: ...

    def on_step(self, step_seconds: float, num_new_tokens: int) -> None: ...

    def on_first_token(
        self, seconds_since_arrival: float, parts: tuple[float, float, float, float] | None
    ) -> None:
        """`parts`: seconds_since_arrival split at the core's readings (FirstTokenTimes.parts),
        None where the core sent none."""

    def on_request_finished(self, finish_reason: str, seconds_since_arrival: float) -> None: ...

    def on_stats(self, stats: CoreStats) -> None: ...


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

    `admitted` waits for the core's verdict on the group: it returns once the core has taken the
    requests, and raises AdmissionError (over the limit), InvalidRequestError or EngineLoopError if
    it refused them, so that the answer can still be a 503 or 400 rather than a stream's error event.
    """

    def __init__(self, owner: AsyncEngine, group_id: str, request_ids: list[str]) -> None:
        self.group_id = group_id
        self.request_ids = request_ids
        self._owner = owner
        self._items: deque[tuple[int, RequestOutput | Exception]] = deque()
        self._ready = asyncio.Event()
        self._unfinished = set(range(len(request_ids)))
        self._verdict: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def admitted(self) -> None:
        await self._verdict

    def _settle(self, error: Exception | None = None) -> None:
        verdict = self._verdict
        if verdict.done():
            return
        if error is None:
            verdict.set_result(None)
        else:
            verdict.set_exception(error)
            verdict.exception()  # retrieved: the stream raises it too, to whoever iterates

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def _put(self, index: int, item: RequestOutput | Exception) -> bool:
        """Called on the event loop; True when this was index's final item."""
        self._settle(item if isinstance(item, Exception) else None)
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
        if self._unfinished:
            self._owner.abort([self.request_ids[index] for index in self._unfinished])


class AsyncEngine:
    """One API process's connection to the engine core; every public method runs on the event loop."""

    def __init__(
        self,
        core: CoreHandle,
        tokenizer: Any,
        max_pending: int | None = None,
        observer: LoopObserver | None = None,
    ) -> None:
        self.core = core
        # Default: twice the sequences one step runs, so a full batch can wait behind the running one.
        self.max_pending = max_pending if max_pending is not None else 2 * core.info.max_num_seqs
        self.observer = observer
        self.accepting = True
        self.on_core_lost: Callable[[], None] | None = None  # called once if the core process dies
        self._outputs = OutputProcessor(tokenizer)
        self._in_flight: dict[str, _InFlight] = {}
        self._awaiting_verdict: dict[str, RequestStream] = {}  # group id -> its stream
        self._calls: dict[int, asyncio.Future[int]] = {}
        self._call_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._context: zmq.asyncio.Context | None = None
        self._socket: zmq.asyncio.Socket | None = None
        self._receiver: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._core_lost = False
        self._heard_from_core = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()

    # -- lifecycle ---------------------------------------------------------------------------------
    async def start(self, timeout: float = 30.0) -> None:
        """Connect to the core and wait for its first stats (its answer to `Hello`), so that /metrics
        is true from the first request on; a core that is gone leaves the engine not alive."""
        self._loop = asyncio.get_running_loop()
        self._idle = asyncio.Event()  # bound to this loop
        self._idle.set()
        self.accepting = True
        self._core_lost = not self.core.is_alive()
        self._context = zmq.asyncio.Context()
        self._socket = without_high_water_marks(self._context.socket(zmq.DEALER), GOODBYE_LINGER_MS)
        self._socket.connect(self.core.address)
        self._send(Hello())
        self._publish(self.core.info.stats)  # the figures it started with, until its answer
        self._heard_from_core = asyncio.Event()
        self._receiver = asyncio.ensure_future(self._receive())
        self._loop.add_reader(self.core.sentinel, self._core_exited)
        heard = asyncio.ensure_future(self._heard_from_core.wait())
        await asyncio.wait({heard, self._receiver}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not heard.done():
            heard.cancel()
            logger.warning("the engine core did not answer within %.0f s", timeout)

    @property
    def is_alive(self) -> bool:
        return self._socket is not None and not self._core_lost

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give the accepted ones `timeout` seconds, then abort the rest."""
        self.accepting = False
        if self._in_flight:
            logger.info("draining: waiting up to %.1fs for %d request(s)", timeout, len(self._in_flight))
            try:
                await asyncio.wait_for(self._idle.wait(), timeout)
            except TimeoutError:
                logger.warning("drain timeout: aborting %d request(s)", len(self._in_flight))
                self.abort(list(self._in_flight))
        logger.info("drained")

    async def stop(self) -> None:
        """Close the connection; the core aborts whatever this process still had running."""
        self.accepting = False
        if self._socket is None:
            return
        self._fail_all("the server stopped before the request finished")
        if not self._core_lost:
            self._send(Goodbye())
        if self._loop is not None:
            self._loop.remove_reader(self.core.sentinel)
        if self._receiver is not None:
            self._receiver.cancel()
            await asyncio.gather(self._receiver, return_exceptions=True)
        self._socket.close()
        self._socket = None
        if self._context is not None:
            self._context.term()
            self._context = None

    async def reset_prefix_cache(self) -> int:
        """Forget the engine's cached prefix blocks, between two steps; returns how many were freed.
        Raises AdmissionError when the engine core is not running."""
        if not self.is_alive:
            raise AdmissionError("the engine core is not running")
        call_id = next(self._call_ids)
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = done
        self._send(ResetPrefixCache(call_id))
        return await done

    # -- requests ----------------------------------------------------------------------------------
    def add(
        self,
        request_id: str,
        prompts: list[list[int]],
        params: SamplingParams,
        seeds: list[int] | None = None,
    ) -> RequestStream:
        """Send len(prompts) engine requests (already validated) to the core, which admits them all or
        none (await the stream's `admitted`); raises AdmissionError at once when this process alone
        is over the limit, or is shutting down, or has lost the core. `seeds`: each request's own
        seed in place of params.seed (core_messages.AddRequest)."""
        self.check_admission(len(prompts))
        request_ids = (
            [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        stream = RequestStream(self, request_id, request_ids)
        self._idle.clear()
        now = time.monotonic()
        observer = self.observer
        for index, token_ids in enumerate(prompts):
            rid = request_ids[index]
            self._outputs.add(rid, token_ids, params)
            self._in_flight[rid] = _InFlight(stream, index, now)
            if observer:
                observer.on_request_added(len(token_ids))
        self._awaiting_verdict[request_id] = stream
        self._send(AddRequest(request_id, request_ids, prompts, params, now, self.max_pending, seeds))
        return stream

    def check_admission(self, count: int, param: str = "prompt") -> None:
        """Raise AdmissionError unless `count` more requests fit under max_pending as far as this
        process knows (the core holds the limit over every API process), and InvalidRequestError (a
        400, naming `param`: the batch, or `n`) for a batch that could never fit, even on an idle
        server."""
        if count > self.max_pending:
            raise InvalidRequestError(
                f"a batch of {count} requests (prompts x n) is more than the server ever accepts at once ({self.max_pending}, --max-pending)",
                param,
            )
        if not self.accepting:
            raise AdmissionError("the server is shutting down")
        if not self.is_alive:
            raise AdmissionError("the engine core is not running")
        if len(self._in_flight) + count > self.max_pending:
            raise AdmissionError(over_the_limit(len(self._in_flight), self.max_pending))

    def abort(self, request_ids: list[str]) -> None:
        """End these requests now (their streams get a final "abort" output) and tell the core."""
        ended = []
        now = time.monotonic()
        for request_id in request_ids:
            entry = self._in_flight.pop(request_id, None)
            if entry is None:  # finished already
                continue
            ended.append(request_id)
            self._awaiting_verdict.pop(entry.stream.group_id, None)
            self._outputs.discard(request_id)
            entry.stream._put(entry.index, RequestOutput.aborted(request_id))
            if self.observer:
                self.observer.on_request_finished("abort", now - entry.arrival_time)
        if ended and not self._core_lost:
            self._send(AbortRequests(ended))
        if not self._in_flight:
            self._idle.set()

    # -- the core's outputs ------------------------------------------------------------------------
    def _send(self, message: CoreRequest) -> None:
        if self._socket is None:
            return
        self._socket.send(self._encoder.encode(message), copy=False)

    async def _receive(self) -> None:
        socket = self._socket
        assert socket is not None
        while True:
            frame = await socket.recv(copy=False)
            try:
                message = OUTPUT_DECODER.decode(frame.buffer)
            except msgspec.DecodeError:
                logger.exception("an undecodable message came from the engine core; dropped")
                continue
            try:
                if isinstance(message, StepOutputs):
                    self._on_step(message)
                else:
                    self._on_call_result(message)
            except Exception:
                logger.exception("handling the engine core's outputs failed")

    def _on_step(self, message: StepOutputs) -> None:
        in_flight = self._in_flight
        observer = self.observer
        now = time.monotonic()
        for group_id in message.admitted:
            admitted = self._awaiting_verdict.pop(group_id, None)
            if admitted is not None:
                admitted._settle()
        num_new_tokens = 0
        stopped: list[str] = []
        for delta in message.deltas:
            request_id = delta.request_id
            entry = in_flight.get(request_id)
            if entry is None:  # aborted here already
                continue
            num_new_tokens += len(delta.new_token_ids)
            output = self._outputs.process(request_id, delta.new_token_ids, delta.finish_reason)
            if ended_by_text(output, delta.finish_reason):
                stopped.append(request_id)
            if observer and not entry.seen_first_token:
                entry.seen_first_token = True
                times = delta.first_token_times
                parts = times.parts(entry.arrival_time, now) if times is not None else None
                observer.on_first_token(now - entry.arrival_time, parts)
            if output.finished:
                del in_flight[request_id]
                if observer:
                    observer.on_request_finished(output.finish_reason or "stop", now - entry.arrival_time)
            entry.stream._put(entry.index, output)
        for failure in message.failures:
            entry = in_flight.pop(failure.request_id, None)
            if entry is None:
                continue
            self._outputs.discard(failure.request_id)
            self._awaiting_verdict.pop(entry.stream.group_id, None)
            error: Exception
            if failure.kind == "invalid":
                error = InvalidRequestError(failure.message, failure.param)
            elif failure.kind == "overloaded":
                error = AdmissionError(failure.message)
            else:
                error = EngineLoopError(failure.message)
            entry.stream._put(entry.index, error)
        if stopped:
            self._send(AbortRequests(stopped))
        if observer and message.step_seconds is not None:
            observer.on_step(message.step_seconds, num_new_tokens)
        self._publish(message.stats)
        self._heard_from_core.set()
        if not in_flight:
            self._idle.set()

    def _on_call_result(self, message: CallResult) -> None:
        self._publish(message.stats)
        done = self._calls.pop(message.call_id, None)
        if done is None or done.done():
            return
        if message.error is None:
            done.set_result(message.value)
        else:
            done.set_exception(EngineLoopError(message.error))

    def _publish(self, stats: CoreStats) -> None:
        if self.observer:
            self.observer.on_stats(stats)

    # -- the core's death --------------------------------------------------------------------------
    def _core_exited(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self.core.sentinel)
        if self._core_lost:
            return
        self._core_lost = True
        self._heard_from_core.set()  # nothing more will come: whoever waits for it, stop waiting
        code = self.core.exitcode
        logger.error(
            "the engine core stopped (exit code %s): failing %d request(s)", code, len(self._in_flight)
        )
        self._fail_all(f"the engine core stopped (exit code {code})")
        if self.on_core_lost is not None:
            self.on_core_lost()

    def _fail_all(self, message: str) -> None:
        for request_id, entry in self._in_flight.items():
            self._outputs.discard(request_id)
            entry.stream._put(entry.index, EngineLoopError(message))
        self._in_flight.clear()
        self._awaiting_verdict.clear()
        for done in self._calls.values():
            if not done.done():
                done.set_exception(EngineLoopError(message))
        self._calls.clear()
        self._idle.set()

"""The engine core in a process of its own: the GPU, the scheduler, the KV cache and the step loop.

The API processes (server/) validate, tokenize, detokenize and speak HTTP; the core only steps. It
owns one ROUTER socket: each API process connects a DEALER socket, sends `CoreRequest`s and hears
one `StepOutputs` per core iteration carrying every one of its requests' new token ids. While work
exists the core takes whatever messages are waiting (without blocking) between steps; when idle it
blocks on the socket, so an idle server burns no CPU (and CI's two cores are not spun away).

A step that finished requests may be followed by a short wait for their replacements: a client that
chains its requests (an agent's calls, a benchmark's closed loop) sends the next as soon as
it reads the last token, a millisecond or two after the core sent it, by when the core has already
scheduled the step after the running one: the new request would wait a whole extra step for its
first token. While the step in flight still runs on the device (and only then: the device is not left
waiting), the core may give up to a fraction of that step's time (`ArrivalWait`; off unless
`python -m server --arrival-wait-ms` sets it) for as many new requests as requests finished, and
schedules the next step as soon as they are in.

`CoreProcess.launch(args)` starts it (multiprocessing spawn: CUDA cannot follow a fork) and waits for
its `CoreInfo`. The core's life hangs on a pipe to its launcher (the lifeline): it exits when the
launcher closes it (`shutdown`) or dies, however it dies (even SIGKILL closes the pipe), so a server
leaves no core behind. Once serving it ignores SIGINT and SIGTERM: a Ctrl-C, or a SIGTERM sent to the
whole process group (systemd, `kill -- -PGID`), must let the API process drain its requests first.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import tempfile
import time
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from multiprocessing.process import BaseProcess
from typing import Protocol, TypeVar

import msgspec
import zmq

from engine.config import EngineArgs
from engine.core_messages import (
    REQUEST_DECODER,
    AbortRequests,
    AddRequest,
    CallResult,
    CoreInfo,
    CoreRequest,
    CoreStats,
    FirstTokenTimes,
    Goodbye,
    Hello,
    RequestFailed,
    ResetPrefixCache,
    StepOutputs,
    TokenDelta,
    over_the_limit,
)
from engine.engine import LLMEngine
from engine.errors import InvalidRequestError

logger = logging.getLogger(__name__)

_ENCODER = msgspec.msgpack.Encoder()


_Socket = TypeVar("_Socket", bound=zmq.Socket)


@dataclass(frozen=True)
class ArrivalWait:
    """How long the core may wait, after a step that finished requests, for new ones before it
    schedules the next step: at most `fraction` of the shorter of the last two steps' wall times (the
    step in flight is about as long, and the rest is left for scheduling and preparing the next one
    before the device runs out of work), and never more than `max_ms` (0: never wait). The wait also
    ends as soon as the step in flight is done, checked every millisecond (the poll's resolution), so
    a step much shorter than the last two costs the device at most that."""

    max_ms: float = 0.0
    fraction: float = 0.3

    def __post_init__(self) -> None:
        if self.max_ms < 0 or not 0 <= self.fraction <= 1:
            raise ValueError(
                f"an arrival wait needs max_ms >= 0 and fraction in [0, 1], got {self.max_ms} and {self.fraction}"
            )

    def budget_s(self, step_seconds: float) -> float:
        return min(self.fraction * step_seconds, self.max_ms / 1e3)


def without_high_water_marks(socket: _Socket, linger_ms: int) -> _Socket:
    """Both ends of the core's connection queue without bound: ZeroMQ's default high-water mark
    (1,000 messages each way) makes a ROUTER silently drop messages to a peer whose queue is full, so
    an API process that lagged ~2,000 steps behind (a GC pause, a starved CPU, a fast GPU) would lose
    token deltas and leave requests waiting forever. The queue is bounded in practice by
    `--max-pending` and the step rate; memory is the right failure, not a silent loss."""
    socket.setsockopt(zmq.SNDHWM, 0)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.LINGER, linger_ms)
    return socket


class CoreStartupError(RuntimeError):
    """The engine core could not start (a bad model folder or option, or it died loading)."""


def core_stats(engine: LLMEngine, num_pending: int = 0) -> CoreStats:
    return CoreStats(engine.stats(), engine.scheduler.num_preemptions, num_pending)


class EngineCore:
    """The core's loop over one ROUTER socket; `run` returns once the lifeline (a pipe's end, or any
    file descriptor) becomes readable: its other end was closed."""

    def __init__(
        self,
        engine: LLMEngine,
        socket: zmq.Socket,
        lifeline: int | None = None,
        arrival_wait: ArrivalWait = ArrivalWait(),
    ) -> None:
        self.engine = engine
        self.socket = socket
        self.lifeline = lifeline
        self.arrival_wait = arrival_wait
        self._arrivals = 0  # requests that reached the core (admitted or not) since start
        # The last step: how many requests it finished, its wall time, and the arrivals before its end.
        self._finished_last_step = 0
        self._step_seconds: deque[float] = deque([0.0], maxlen=2)
        self._arrivals_at_step_end = 0
        self._poller = zmq.Poller()
        self._poller.register(socket, zmq.POLLIN)
        if lifeline is not None:
            self._poller.register(lifeline, zmq.POLLIN)
        self._stopping = False
        self._owner: dict[str, bytes] = {}  # request id -> the API process (socket identity) it came from
        # request id -> time.monotonic() when the core took it, until its first token goes out
        self._received: dict[str, float] = {}
        self._clients: set[bytes] = set()
        self._failures: defaultdict[bytes, list[RequestFailed]] = defaultdict(list)
        self._admitted: defaultdict[bytes, list[str]] = defaultdict(list)

    def run(self) -> None:
        engine = self.engine
        while not self._stopping:
            busy = engine.has_unfinished_requests()
            took = self._take_messages(0 if busy else None)
            if busy and self._finished_last_step and self.arrival_wait.max_ms > 0:
                took += self._wait_for_arrivals()
            if self._stopping:
                break
            if self._admitted or self._failures:
                self._send_verdicts()
            if engine.has_unfinished_requests():
                self._step()
            elif took:
                self._send_all(None, {})  # e.g. aborts: the stats show their freed blocks

    def _wait_for_arrivals(self) -> int:
        """After a step that finished requests: take messages until as many requests as finished have
        arrived, the wait's budget is spent, or the step in flight is done; returns how many."""
        expected = self._arrivals_at_step_end + self._finished_last_step
        # The step in flight is about as long as the shorter of the last two (a long prefill step is
        # often followed by a short decode step: the budget is a fraction of the short one).
        deadline = time.perf_counter() + self.arrival_wait.budget_s(min(self._step_seconds))
        took = 0
        while self._arrivals < expected and self.engine.is_step_running():
            left_ms = (deadline - time.perf_counter()) * 1e3
            if left_ms < 0.5:  # the poll's resolution is a millisecond
                break
            took += self._take_messages(1)
            if self._stopping:
                break
        return took

    # -- messages in -----------------------------------------------------------------------------
    def _take_messages(self, timeout_ms: int | None) -> int:
        """Handle every waiting message (waiting up to timeout_ms for the first, or forever when None);
        returns how many. A closed lifeline stops the loop."""
        events = dict(self._poller.poll(timeout_ms))
        if self.lifeline is not None and self.lifeline in events:
            logger.info("the engine core's launcher closed its lifeline: exiting")
            self._stopping = True
            return 0
        if self.socket not in events:
            return 0
        count = 0
        while True:
            try:
                identity, payload = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return count
            count += 1
            try:
                message = REQUEST_DECODER.decode(payload.buffer)
            except msgspec.DecodeError:
                logger.exception("an undecodable message reached the engine core; dropped")
                continue
            self._handle(bytes(identity.buffer), message)

    def _handle(self, client: bytes, message: CoreRequest) -> None:
        engine = self.engine
        if isinstance(message, AddRequest):
            self._clients.add(client)
            self._add(client, message)
        elif isinstance(message, AbortRequests):
            for request_id in message.request_ids:
                if self._owner.pop(request_id, None) is not None:
                    self._abort(request_id)
        elif isinstance(message, ResetPrefixCache):
            try:
                result = CallResult(message.call_id, engine.reset_prefix_cache(), self._stats())
            except Exception as error:
                logger.exception("resetting the prefix cache failed")
                result = CallResult(
                    message.call_id, 0, self._stats(), f"reset failed: {type(error).__name__}"
                )
            self.socket.send_multipart([client, _ENCODER.encode(result)])
        elif isinstance(message, Hello):
            self._clients.add(client)
        elif isinstance(message, Goodbye):
            for request_id in [r for r, c in self._owner.items() if c == client]:
                del self._owner[request_id]
                self._abort(request_id)
            self._clients.discard(client)
            self._failures.pop(client, None)
            self._admitted.pop(client, None)

    def _add(self, client: bytes, message: AddRequest) -> None:
        """Admit the group whole, or fail each of its requests: over the admission limit
        ("overloaded"), refused by the engine's own checks ("invalid"), or an engine fault."""
        request_ids = message.request_ids
        self._arrivals += len(request_ids)
        pending = len(self._owner)
        if pending + len(request_ids) > message.max_pending:
            reason = over_the_limit(pending, message.max_pending)
            self._failures[client].extend(RequestFailed(r, "overloaded", reason) for r in request_ids)
            return
        engine = self.engine
        received = time.monotonic()
        added: list[str] = []
        for index, (request_id, prompt) in enumerate(zip(request_ids, message.prompts, strict=True)):
            params = message.params
            if message.seeds is not None:
                params = replace(params, seed=message.seeds[index])
            try:
                engine.add_request(request_id, prompt, params, message.arrival_time)
            except Exception as error:  # a bad request fails alone; the loop goes on
                if isinstance(error, InvalidRequestError):
                    kind, text, param = "invalid", error.message, error.param
                else:
                    logger.exception("add_request failed for %s", request_id)
                    kind, text = "engine", f"the engine could not take the request: {type(error).__name__}"
                    param = None
                for earlier in added:  # all or none: the group's other requests go too
                    self._abort(earlier)
                self._failures[client].extend(RequestFailed(r, kind, text, param) for r in request_ids)
                return
            added.append(request_id)
        for request_id in added:
            self._owner[request_id] = client
            self._received[request_id] = received
        self._admitted[client].append(message.group_id)

    def _abort(self, request_id: str) -> None:
        self._received.pop(request_id, None)
        try:
            self.engine.abort(request_id)
        except Exception:
            logger.exception("abort failed for %s", request_id)

    # -- a step and its outputs ------------------------------------------------------------------
    def _step(self) -> None:
        start = time.perf_counter()
        self._finished_last_step = 0
        try:
            outputs = self.engine.step()
        except Exception:
            # The engine's state after a failed step is unknown: fail everything in it, keep serving.
            logger.exception("engine step failed; failing %d request(s)", len(self._owner))
            for request_id, client in self._owner.items():
                self._abort(request_id)
                self._failures[client].append(
                    RequestFailed(request_id, "engine", "the engine failed while generating")
                )
            self._owner.clear()
            self._received.clear()
            self._send_all(None, {})
            return
        seconds = time.perf_counter() - start
        deltas: defaultdict[bytes, list[TokenDelta]] = defaultdict(list)
        owner = self._owner
        sent = time.monotonic()
        for output in outputs:
            sender = owner.get(output.request_id)
            if sender is None:  # aborted meanwhile
                continue
            if output.finished:
                del owner[output.request_id]
                self._finished_last_step += 1
            times = None
            received = self._received.pop(output.request_id, None)  # present until its first output
            if received is not None and output.first_scheduled_time is not None:
                times = FirstTokenTimes(received, output.first_scheduled_time, sent)
            # finish_reason is None until the last output (the core's engine finds no stop strings)
            deltas[sender].append(
                TokenDelta(output.request_id, output.new_token_ids, output.finish_reason, times)
            )
        self._send_all(seconds, deltas)
        self._step_seconds.append(seconds)
        self._arrivals_at_step_end = self._arrivals

    def _send_verdicts(self) -> None:
        """Tell the API processes at once which of their new requests were admitted or refused, so
        that a refusal (a 503 or 400) does not wait for the step."""
        self._send(self._admitted.keys() | self._failures.keys(), None, {})

    def _stats(self) -> CoreStats:
        return core_stats(self.engine, len(self._owner))

    def _send_all(self, step_seconds: float | None, deltas: dict[bytes, list[TokenDelta]]) -> None:
        """One message to every known API process: what it had admitted, its deltas and failures,
        and everyone's stats."""
        self._send(self._clients, step_seconds, deltas)

    def _send(
        self, clients: Iterable[bytes], step_seconds: float | None, deltas: dict[bytes, list[TokenDelta]]
    ) -> None:
        stats = self._stats()
        admitted, failures = self._admitted, self._failures
        for client in list(clients):
            message = StepOutputs(
                admitted.pop(client, []),
                deltas.get(client, []),
                failures.pop(client, []),
                stats,
                step_seconds,
            )
            self.socket.send_multipart([client, _ENCODER.encode(message)], copy=False)


# -- the process ----------------------------------------------------------------------------------
CORE_PROCESS_NAME = "engine-core"


def name_this_process(name: str) -> None:
    """Give this process a name that `ps`, `top` and /proc/PID/comm show (Linux, 15 characters at
    most; elsewhere nothing). Spawned processes otherwise all read as `python3` with the same
    multiprocessing command line, so the core could not be told from an API process by looking."""
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(name[:15])
    except OSError:
        pass


def run_engine_core(
    args: EngineArgs,
    address: str,
    lifeline: multiprocessing.connection.Connection,
    setup: Callable[[], None] | None = None,
    arrival_wait: ArrivalWait = ArrivalWait(),
) -> None:
    """The core process's main: build the engine, report `CoreInfo` (or the error) on the lifeline,
    then loop until the lifeline closes. It then leaves by `os._exit`, without the interpreter's
    teardown (freeing the KV cache and the model tensor by tensor, unloading torch: 0.8 s of a
    CPU core's 0.9-s exit) that a process about to end does not need; its sockets are closed and
    its log flushed first."""
    name_this_process(CORE_PROCESS_NAME)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s [core pid=%(process)d]: %(message)s"
    )
    try:
        if setup is not None:
            setup()
        engine = LLMEngine(args, detokenize=False)
    except Exception as error:
        lifeline.send(("error", f"{type(error).__name__}: {error}"))
        raise SystemExit(2) from error
    context = zmq.Context()
    socket = without_high_water_marks(context.socket(zmq.ROUTER), linger_ms=0)
    socket.bind(address)
    core = EngineCore(engine, socket, lifeline.fileno(), arrival_wait)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # serving: the API process decides when to stop
    lifeline.send(("ready", _ENCODER.encode(core_info(engine))))
    try:
        core.run()
    finally:
        socket.close()
        context.term()
    logging.shutdown()
    os._exit(0)


def core_info(engine: LLMEngine) -> CoreInfo:
    import torch

    device = engine.device
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device_name, gpu = f"cuda:{index}", torch.cuda.get_device_name(index)
    else:
        device_name, gpu = device.type, None
    return CoreInfo(
        model=engine.args.model,
        vocab_size=engine.model_config.vocab_size,
        max_model_len=engine.max_model_len,
        max_num_seqs=engine.max_num_seqs,
        device=device_name,
        gpu_name=gpu,
        config=engine.config_dict(),
        stats=core_stats(engine),
    )


class CoreHandle(Protocol):
    """What an API process needs of a running core: the address to connect to, what it serves, and
    a file descriptor that becomes readable when the core process ends."""

    address: str
    info: CoreInfo

    @property
    def sentinel(self) -> int: ...

    def is_alive(self) -> bool: ...

    @property
    def exitcode(self) -> int | None: ...


class RemoteCore:
    """A core that another process launched, as the API processes of `--api-server-count N` see it:
    picklable under spawn (the watch pipe, a copy of the core process's sentinel, travels as a
    duplicated descriptor), so a process that is not the core's parent still learns of its end."""

    def __init__(self, address: str, info: CoreInfo, watch: multiprocessing.connection.Connection) -> None:
        self.address = address
        self.info = info
        self._watch = watch

    @property
    def sentinel(self) -> int:
        return self._watch.fileno()

    def is_alive(self) -> bool:
        return not self._watch.poll()  # the pipe reads EOF once the core has exited

    @property
    def exitcode(self) -> int | None:
        return None  # known only to the core's parent

    def close(self) -> None:
        """Drop this process's copy of the watch pipe (once the handle has been passed on)."""
        self._watch.close()


class CoreProcess:
    """A running engine core: its process, the address API processes connect to, its `CoreInfo`."""

    def __init__(
        self,
        process: BaseProcess,
        address: str,
        info: CoreInfo,
        lifeline: multiprocessing.connection.Connection,
        ipc_dir: str,
    ) -> None:
        self.process = process
        self.address = address
        self.info = info
        self._lifeline = lifeline
        self._ipc_dir = ipc_dir

    @classmethod
    def launch(
        cls,
        args: EngineArgs,
        startup_timeout: float = 1800.0,
        setup: Callable[[], None] | None = None,
        arrival_wait: ArrivalWait = ArrivalWait(),
    ) -> CoreProcess:
        """Start the core and wait until it serves; raises CoreStartupError naming what failed.
        `setup` (a picklable, importable function) runs in the core before the engine is built."""
        context = multiprocessing.get_context("spawn")
        ipc_dir = tempfile.mkdtemp(prefix="paged-engine-")
        address = f"ipc://{ipc_dir}/core"
        ours, theirs = context.Pipe()
        process = context.Process(
            target=run_engine_core,
            args=(args, address, theirs, setup, arrival_wait),
            name=CORE_PROCESS_NAME,
            daemon=True,
        )
        process.start()
        theirs.close()
        ready = multiprocessing.connection.wait([ours, process.sentinel], startup_timeout)
        if ours in ready:
            try:
                kind, payload = ours.recv()
            except EOFError:
                kind, payload = "error", "it exited while starting"
        elif ready:
            kind, payload = "error", "it exited while starting"
        else:
            kind, payload = "error", f"not ready after {startup_timeout:.0f} s"
        if kind != "ready":
            ours.close()
            _stop_process(process, 10.0)
            shutil.rmtree(ipc_dir, ignore_errors=True)
            raise CoreStartupError(f"the engine core did not start: {payload} (exit code {process.exitcode})")
        return cls(process, address, msgspec.msgpack.decode(payload, type=CoreInfo), ours, ipc_dir)

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core process ends."""
        return self.process.sentinel

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def remote(self) -> RemoteCore:
        """A handle for a process this one spawns (pass it as a Process argument, then close it)."""
        watch = multiprocessing.connection.Connection(os.dup(self.process.sentinel), writable=False)
        return RemoteCore(self.address, self.info, watch)

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def shutdown(self, timeout: float = 10.0) -> None:
        """Close the lifeline (the core finishes its iteration and exits), SIGKILL after `timeout`
        seconds; idempotent."""
        self._lifeline.close()
        self.process.join(timeout)
        _stop_process(self.process, 0.0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)


def _stop_process(process: BaseProcess, timeout: float) -> None:
    """SIGTERM (honoured while the core is still starting), then SIGKILL."""
    if process.is_alive() and timeout > 0:
        process.terminate()
        process.join(timeout)
    if process.is_alive():
        logger.warning("the engine core did not stop in %.0f s: killing it", timeout)
        process.kill()
        process.join(5.0)

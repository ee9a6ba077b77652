"""Several API processes in front of one engine core: `python -m server --api-server-count N`.

One API process parses HTTP, tokenizes, detokenizes and writes SSE on one core's worth of Python;
past that, more processes serve the same port. The launcher (the process `python -m server` started)
binds the listening socket, starts the engine core, then spawns N API processes that each accept on
that socket (the kernel spreads connections over them) and keep their own connection to the core. The
core holds the one admission limit over all of them (`AddRequest.max_pending`), and /metrics adds up
every process's counters (server/metrics.py).

The launcher only supervises. Signals go to it: the first SIGTERM/SIGINT tells every API process to
drain (each refuses new requests with 503 and lets its accepted ones finish), a second one tells them
to exit now; then the core is stopped. The API processes ignore both signals, so a SIGTERM sent to
the whole process group drains once, not twice. If the core dies, each API process sees it itself
(the core's sentinel, handed down), fails its requests and exits 1, and so does the launcher. If an
API process dies, the server goes down whole (exit 1) rather than serve on with a part missing. If
the launcher dies, its API processes see their control pipe close and exit, and the core its lifeline.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any

from engine.core_process import CoreProcess, RemoteCore, name_this_process
from server.metrics import ServerMetrics
from server.serving import DRAIN, EXIT, ApiProcessServer, app_from_flags, uvicorn_config

logger = logging.getLogger("server")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"  # prometheus_client reads it when it is imported
READY_TIMEOUT_S = 300.0  # an API process loads the tokenizer and connects to the core
STOP_GRACE_S = 15.0  # past the drain timeout, before an API process that has not exited is killed


@dataclass
class _ApiProcess:
    index: int
    process: BaseProcess
    control: multiprocessing.connection.Connection  # the launcher's end: commands out, "ready" in


def serve_with_api_processes(args: argparse.Namespace, core: CoreProcess) -> int:
    """The launcher's part: bind, spawn args.api_server_count API processes, supervise; returns the
    exit status."""
    listener = uvicorn_config(args, app=None).bind_socket()
    host, port = listener.getsockname()[:2]
    metrics_dir = tempfile.mkdtemp(prefix="paged-engine-metrics-")
    os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by the spawned processes
    context = multiprocessing.get_context("spawn")
    processes: list[_ApiProcess] = []
    try:
        for index in range(args.api_server_count):
            ours, theirs = context.Pipe()
            remote = core.remote()
            process = context.Process(
                target=run_api_process,
                args=(args, remote, listener, index, theirs, metrics_dir),
                name=f"api-server-{index}",
            )
            process.start()
            theirs.close()
            remote.close()
            processes.append(_ApiProcess(index, process, ours))
        listener.close()  # the API processes hold it now
        if not _wait_ready(processes, core):
            return 1
        logger.info(
            "ready: serving %r at http://%s:%d (engine on %s; %d API processes)",
            args.served_model_name or args.model,
            host,
            port,
            core.info.device,
            len(processes),
        )
        return _supervise(processes, core, args.shutdown_timeout)
    finally:
        for api in processes:
            if api.process.is_alive():
                api.process.kill()
            api.process.join(5)
        shutil.rmtree(metrics_dir, ignore_errors=True)


def _wait_ready(processes: list[_ApiProcess], core: CoreProcess) -> bool:
    waiting = {api.control: api for api in processes}
    sentinels = {api.process.sentinel: api for api in processes}
    while waiting:
        ready = multiprocessing.connection.wait(
            [*waiting, *sentinels, core.sentinel], timeout=READY_TIMEOUT_S
        )
        if not ready:
            logger.error("the API processes did not start within %.0f s", READY_TIMEOUT_S)
            return False
        for item in ready:
            if item == core.sentinel:
                logger.error("the engine core stopped while the API processes started")
                return False
            if item in sentinels:
                logger.error("API process %d exited while starting", sentinels[item].index)  # type: ignore[index]
                return False
            api = waiting.pop(item)  # type: ignore[call-overload]
            api.control.recv()
    return True


def _supervise(processes: list[_ApiProcess], core: CoreProcess, shutdown_timeout: float) -> int:
    """Wait for signals and deaths; returns 0 when every API process exited 0 after a drain."""
    wake_read, wake_write = socket.socketpair()
    wake_write.setblocking(False)
    signals: list[int] = []
    previous = signal.set_wakeup_fd(wake_write.fileno())
    handlers = {sig: signal.signal(sig, lambda sig, frame: signals.append(sig)) for sig in _SIGNALS}
    status = 0
    deadline: float | None = None
    handled = 0
    try:
        running = {api.process.sentinel: api for api in processes}
        core_watched = True
        while running:
            watched: list[Any] = [wake_read, *running]
            if core_watched:
                watched.append(core.sentinel)
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = multiprocessing.connection.wait(watched, timeout)
            if wake_read in ready:
                wake_read.recv(4096)
            while handled < len(signals):
                handled += 1
                command = DRAIN if handled == 1 else EXIT
                logger.info("signal %d: telling the API processes to %s", signals[handled - 1], command)
                _tell(running.values(), command)
                deadline = time.monotonic() + shutdown_timeout + STOP_GRACE_S
            if core_watched and core.sentinel in ready:
                core_watched = False
                status = 1
                logger.error("the engine core stopped (exit code %s)", core.exitcode)
                deadline = time.monotonic() + STOP_GRACE_S  # its API processes fail their requests and exit 1
            for sentinel in [s for s in ready if s in running]:
                api = running.pop(sentinel)  # type: ignore[call-overload]
                api.process.join()
                code = api.process.exitcode
                if code != 0 or not signals:
                    status = 1
                    if not signals and core_watched:
                        logger.error("API process %d exited (code %s): stopping the server", api.index, code)
                        _tell(running.values(), EXIT)
                        deadline = time.monotonic() + STOP_GRACE_S
            if deadline is not None and time.monotonic() > deadline and running:
                logger.warning("killing %d API process(es) that did not exit", len(running))
                for api in running.values():
                    api.process.kill()
                deadline = time.monotonic() + STOP_GRACE_S
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        signal.set_wakeup_fd(previous)
        wake_read.close()
        wake_write.close()
    return status


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _tell(processes: Any, command: str) -> None:
    for api in processes:
        with contextlib.suppress(OSError):  # exited meanwhile
            api.control.send(command)


# -- an API process -------------------------------------------------------------------------------
def run_api_process(
    args: argparse.Namespace,
    core: RemoteCore,
    listener: socket.socket,
    index: int,
    control: multiprocessing.connection.Connection,
    metrics_dir: str,
) -> None:
    """The main of API process `index`: serve the app on the shared socket until told to drain or to
    exit, until the core dies (exit 1) or until the launcher goes away."""
    name_this_process(f"api-server-{index}")
    for sig in _SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # the launcher decides, and says so over `control`
    logging.basicConfig(
        level=args.log_level.upper(),
        format=f"%(asctime)s %(levelname)s %(name)s [api {index} pid=%(process)d]: %(message)s",
        stream=sys.stderr,
    )
    app = app_from_flags(args, core, ServerMetrics(multiprocess_dir=metrics_dir, records_steps=index == 0))
    server = ApiProcessServer(
        uvicorn_config(args, app),
        app.state.async_engine,
        args.shutdown_timeout,
        app.state.served_model_name,
        control,
    )
    logger.info("API process %d: serving the shared socket", index)
    server.run(sockets=[listener])
    raise SystemExit(1 if server.core_lost or not server.started else 0)

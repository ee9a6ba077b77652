"""uvicorn as the server runs it: the HTTP stack, and a uvicorn.Server that drains the engine's
requests before it shuts down.

`DrainingServer` (one API process, `python -m server`): on SIGTERM/SIGINT new requests get 503 while
the accepted ones finish (up to the shutdown timeout, then they are aborted), then uvicorn closes. A
second signal exits at once. If the engine core dies it exits at once, `core_lost` set.
`ApiProcessServer` (one of `--api-server-count N`): the same, but it serves a socket its launcher
bound, ignores signals, and drains or exits when the launcher says so over its control pipe.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import logging
import multiprocessing.connection
import socket
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from engine.core_process import CoreHandle
from server.app import create_app
from server.async_engine import AsyncEngine
from server.metrics import ServerMetrics

logger = logging.getLogger("server")

UVICORN_GRACE_SECONDS = 5  # after the drain, for connections that still do not close
# What a launcher and its API processes say over their control pipe.
READY, DRAIN, EXIT = "ready", "drain", "exit"


def http_stack() -> tuple[str, str]:
    """uvicorn's HTTP parser and event loop: httptools and uvloop where installed (the server extra
    installs both; uvloop has no Windows build), else h11 and asyncio.

    Each streamed token is an SSE event the event loop writes; with httptools and uvloop the server
    (then one process, the engine loop beside the event loop) spent 22.7 us of CPU a token instead of
    29-30 on h11 and asyncio (`python -m bench host-cost`, 64 streams, 2-core machine).
    """
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return http, loop


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the engine before uvicorn shuts down."""

    def __init__(
        self, config: uvicorn.Config, async_engine: AsyncEngine, shutdown_timeout: float, model_name: str
    ) -> None:
        super().__init__(config)
        self.async_engine = async_engine
        self.shutdown_timeout = shutdown_timeout
        self.model_name = model_name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None
        self._signalled = False
        self.core_lost = False
        async_engine.on_core_lost = self._on_core_lost

    def _on_core_lost(self) -> None:
        """The requests in flight have failed already: nothing to drain, exit now (status 1)."""
        self.core_lost = True
        self.should_exit = True

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            logger.info(
                "ready: serving %r at http://%s:%d (engine on %s; HTTP %s, event loop %s)",
                self.model_name,
                host,
                port,
                self.async_engine.core.info.device,
                self.config.http,
                self.config.loop,
            )

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Runs as a signal handler on the event loop's thread; uvicorn's own version would also
        # re-raise the signal after shutdown, turning a clean drain into exit status -15.
        if self._signalled or self._loop is None:
            logger.warning("second signal: exiting now")
            self.exit_now()
            return
        self._signalled = True
        logger.info("signal %d: refusing new requests, draining", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def exit_now(self) -> None:
        self.should_exit = True
        self.force_exit = True

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.async_engine.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True


class ApiProcessServer(DrainingServer):
    """One of several API processes (server/api_processes.py): it serves a socket its launcher bound,
    ignores signals, and drains or exits when the launcher says so over `control`."""

    def __init__(
        self,
        config: uvicorn.Config,
        async_engine: AsyncEngine,
        shutdown_timeout: float,
        model_name: str,
        control: multiprocessing.connection.Connection,
    ) -> None:
        super().__init__(config, async_engine, shutdown_timeout, model_name)
        self.control = control

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # the launcher handles the signals

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await uvicorn.Server.startup(self, sockets)
        if self.started:
            asyncio.get_running_loop().add_reader(self.control.fileno(), self._on_control)
            self.control.send(READY)

    def _on_control(self) -> None:
        """The launcher's command (or its end, read as: exit now)."""
        try:
            command = self.control.recv()
        except (EOFError, OSError):
            command = EXIT
            asyncio.get_running_loop().remove_reader(self.control.fileno())
        self.command(command)

    def command(self, command: str) -> None:
        if command == DRAIN and not self._signalled:
            self._signalled = True
            logger.info("told to drain: refusing new requests")
            self._start_drain()
        else:
            logger.info("told to exit")
            self.exit_now()


def uvicorn_config(args: argparse.Namespace, app: Any) -> uvicorn.Config:
    """uvicorn's settings from the server's flags (`app` None: only to bind the socket)."""
    http, loop = http_stack()
    return uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        http=http,
        loop=loop,
        log_level=args.log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_graceful_shutdown=UVICORN_GRACE_SECONDS,
        lifespan="on",
    )


def app_from_flags(
    args: argparse.Namespace, core: CoreHandle, metrics: ServerMetrics | None = None
) -> FastAPI:
    """`create_app` with the server's flags: the one app an API process serves."""
    return create_app(
        core,
        args.served_model_name,
        max_pending=args.max_pending,
        shutdown_timeout=args.shutdown_timeout,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
        metrics=metrics,
    )

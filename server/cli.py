"""`python -m server --model DIR ...`: parse flags, start the engine core's process, serve the app.

Engine flags are spelled as vLLM spells them and mapped onto EngineArgs fields; the engine core gets
them in its own process (engine/core_process.py) and this process serves HTTP. `DrainingServer` adds
a graceful shutdown to uvicorn's: on SIGTERM/SIGINT new requests get 503 while the accepted ones
finish (up to --shutdown-timeout, then they are aborted), then uvicorn closes, the core is stopped
and the process exits 0. A second signal exits at once. If the core dies, the requests in flight
fail, /health answers 503 and the process exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import logging
import os
import signal
import socket
import sys
import tracemalloc
from collections.abc import Callable, Sequence
from types import FrameType

import uvicorn

from engine import EngineArgs
from engine.attention import BACKEND_NAMES
from engine.core_process import CoreProcess, CoreStartupError
from server.app import create_app
from server.async_engine import AsyncEngine
from server.guards import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger("server")

# (flag as vLLM spells it, EngineArgs field, type, help)
ENGINE_FLAGS: tuple[tuple[str, str, type, str], ...] = (
    (
        "--max-model-len",
        "max_model_len",
        int,
        "context length (default: the model's max_position_embeddings)",
    ),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences in one step"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget of one step"),
    ("--block-size", "block_size", int, "tokens per KV cache block"),
    ("--num-kv-blocks", "num_kv_blocks", int, "KV cache blocks (default: measured from free memory)"),
    ("--kv-cache-memory", "kv_cache_memory", int, "bytes of KV cache (instead of --num-kv-blocks)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "fraction of GPU memory to use"),
    ("--dtype", "dtype", str, "auto, float32, bfloat16 or float16"),
    ("--device", "device", str, "auto, cpu or cuda[:N]"),
    ("--seed", "seed", int, "random seed"),
)
API_KEY_ENV = "PAGED_ENGINE_API_KEY"
TRACEMALLOC_ENV = "PAGED_ENGINE_TRACEMALLOC"  # set (to anything): trace the Python heap for /metrics
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
UVICORN_GRACE_SECONDS = 5  # after the drain, for connections that still do not close


def http_stack() -> tuple[str, str]:
    """uvicorn's HTTP parser and event loop: httptools and uvloop where installed (the server extra
    installs both; uvloop has no Windows build), else h11 and asyncio.

    Each streamed token is an SSE event the event loop writes, on the thread that shares the GIL with
    the engine loop; with httptools and uvloop the server spent 22.7 us of CPU a token instead of
    29-30 on h11 and asyncio (`python -m bench host-cost`, 64 streams, 2-core machine).
    """
    http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    return http, loop


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server", description="OpenAI-compatible HTTP server over the engine."
    )
    parser.add_argument("--model", required=True, help="Hugging Face model folder")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument(
        "--port", type=int, default=8000, help="0 picks a free port (the ready line names it)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (default: --model as given)"
    )
    parser.add_argument(
        "--max-pending",
        type=int,
        default=None,
        help="accepted, unfinished requests past which new ones get 503 (default: 2 x max_num_seqs in force)",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        help="larger request bodies get 413 (default: %(default)s, 16 MiB)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV) or None,
        help=f"require `Authorization: Bearer KEY` on /v1/ routes (default: ${API_KEY_ENV}, which keeps "
        "the key out of process listings); /health, /metrics and /version stay open",
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"]
    )
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", help="no log line per request")
    engine_group = parser.add_argument_group("engine")
    for flag, field, kind, help_text in ENGINE_FLAGS:
        engine_group.add_argument(flag, dest=field, type=kind, default=None, help=help_text)
    engine_group.add_argument(
        "--enforce-eager", dest="enforce_eager", action="store_true", default=None, help="no CUDA graphs"
    )
    engine_group.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="share the KV of prompt prefixes earlier requests computed (default: on, as in vLLM)",
    )
    engine_group.add_argument(
        "--attention-backend",
        dest="attention_backend",
        choices=BACKEND_NAMES,
        default=None,
        help="auto (triton on CUDA, torch elsewhere), torch (the reference) or triton",
    )
    return parser


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the parsed flags; flags not given keep EngineArgs' defaults."""
    given = {
        name: getattr(args, name)
        for name in EngineArgs.field_names()
        if name != "model" and getattr(args, name, None) is not None
    }
    return EngineArgs(model=args.model, **given)


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
            self.should_exit = True
            self.force_exit = True
            return
        self._signalled = True
        logger.info("signal %d: refusing new requests, draining", sig)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.async_engine.drain(self.shutdown_timeout)
        finally:
            self.should_exit = True


def main(argv: Sequence[str] | None = None, core_setup: Callable[[], None] | None = None) -> int:
    """`core_setup` (importable, picklable) runs in the engine core's process before the engine is
    built: `bench host-cost` replaces the model there."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        core = CoreProcess.launch(engine_args(args), setup=core_setup)
    except (CoreStartupError, ValueError, FileNotFoundError, OSError) as error:
        logger.error("cannot start the engine: %s", error)
        return 2
    try:
        return _serve(args, core)
    finally:
        core.shutdown()


def _serve(args: argparse.Namespace, core: CoreProcess) -> int:
    app = create_app(
        core,
        args.served_model_name,
        max_pending=args.max_pending,
        shutdown_timeout=args.shutdown_timeout,
        api_key=args.api_key,
        max_request_bytes=args.max_request_bytes,
    )
    if args.api_key:
        logger.info("an API key is required on /v1/ routes")
    http, loop = http_stack()
    config = uvicorn.Config(
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
    if os.environ.get(TRACEMALLOC_ENV):
        # Started once the engine is built: tracing torch's imports from the start (PYTHONTRACEMALLOC)
        # takes minutes. /metrics then shows the heap (server_python_heap_traced_bytes).
        tracemalloc.start()
    server = DrainingServer(
        config, app.state.async_engine, args.shutdown_timeout, app.state.served_model_name
    )
    server.run()
    if server.core_lost:
        logger.error("exiting: the engine core stopped")
        return 1
    return 0 if server.started else 1

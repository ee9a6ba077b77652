"""`python -m server --model DIR ...`: parse flags, start the engine core's process, serve the app.

Engine flags are spelled as vLLM spells them and mapped onto EngineArgs fields; the engine core gets
them in its own process (engine/core_process.py) and this process serves HTTP through uvicorn with a
draining shutdown (server/serving.py): on SIGTERM/SIGINT new requests get 503 while the accepted ones
finish (up to --shutdown-timeout, then they are aborted), then uvicorn closes, the core is stopped
and the process exits 0. A second signal exits at once. If the core dies, the requests in flight
fail, /health answers 503 and the process exits 1. With `--api-server-count N` (N > 1) this process
only supervises N API processes that serve the port (server/api_processes.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tracemalloc
from collections.abc import Callable, Sequence

from engine import EngineArgs
from engine.attention import BACKEND_NAMES
from engine.core_process import ArrivalWait, CoreProcess, CoreStartupError
from server.api_processes import serve_with_api_processes
from server.guards import DEFAULT_MAX_REQUEST_BYTES
from server.serving import DrainingServer, app_from_flags, uvicorn_config

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
    (
        "--mixed-graph-max-tokens",
        "mixed_graph_max_tokens",
        int,
        f"steps with prompt chunks, up to this many tokens, replay CUDA graphs (0: eager; default {EngineArgs.mixed_graph_max_tokens})",
    ),
    (
        "--mixed-graph-ladder-steps",
        "mixed_graph_ladder_steps",
        int,
        f"graph sizes for those steps from each power of two tokens to the next (more: less padding, more graphs; default {EngineArgs.mixed_graph_ladder_steps})",
    ),
)
API_KEY_ENV = "PAGED_ENGINE_API_KEY"
TRACEMALLOC_ENV = "PAGED_ENGINE_TRACEMALLOC"  # set (to anything): trace the Python heap for /metrics


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
    parser.add_argument(
        "--arrival-wait-ms",
        type=_non_negative_float,
        default=ArrivalWait.max_ms,
        help="after a step that finished requests, the engine core may wait this long (at most 0.3 of "
        "a step, and only while the GPU still runs the step in flight) for their clients' next requests "
        "before it schedules the next step, so that they start one step sooner (0: never; default: %(default)s)",
    )
    parser.add_argument(
        "--api-server-count",
        type=_positive_int,
        default=1,
        help="API processes serving the port in front of the one engine core (vLLM's name); more than "
        "one spreads tokenization, detokenization and SSE over more cores (default: %(default)s)",
    )
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


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value:g}")
    return value


def engine_args(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs from the parsed flags; flags not given keep EngineArgs' defaults."""
    given = {
        name: getattr(args, name)
        for name in EngineArgs.field_names()
        if name != "model" and getattr(args, name, None) is not None
    }
    return EngineArgs(model=args.model, **given)


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
        core = CoreProcess.launch(
            engine_args(args), setup=core_setup, arrival_wait=ArrivalWait(max_ms=args.arrival_wait_ms)
        )
    except (CoreStartupError, ValueError, FileNotFoundError, OSError) as error:
        logger.error("cannot start the engine: %s", error)
        return 2
    try:
        if args.api_key:
            logger.info("an API key is required on /v1/ routes")
        if args.api_server_count > 1:
            return serve_with_api_processes(args, core)
        return _serve(args, core)
    finally:
        core.shutdown()


def _serve(args: argparse.Namespace, core: CoreProcess) -> int:
    app = app_from_flags(args, core)
    if os.environ.get(TRACEMALLOC_ENV):
        # Started once the engine is built: tracing torch's imports from the start (PYTHONTRACEMALLOC)
        # takes minutes. /metrics then shows the heap (server_python_heap_traced_bytes).
        tracemalloc.start()
    server = DrainingServer(
        uvicorn_config(args, app), app.state.async_engine, args.shutdown_timeout, app.state.served_model_name
    )
    server.run()
    if server.core_lost:
        logger.error("exiting: the engine core stopped")
        return 1
    return 0 if server.started else 1

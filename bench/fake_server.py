"""A fake OpenAI-compatible streaming server whose timings are known: for testing the client.

`create_app(FakeServerConfig(...))` is a Starlette app serving `/v1/completions` and
`/v1/chat/completions` (SSE), `/v1/models` and `/version`; `FakeServerThread` and `FakeServerProcess` run it under uvicorn on 127.0.0.1 with a
free port. The bench tests use it; users can too: `python -m bench.fake_server --ttft-s 0.1 --itl-s 0.02`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, fields
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route


@dataclass(frozen=True)
class FakeServerConfig:
    """Timings and faults. A request waits for one of `slots`, then its first chunk comes `ttft_s`
    later and each next chunk `itl_s` after the one before (on an absolute schedule, so sleeps do not
    drift); each chunk carries `tokens_per_chunk` tokens. Every `fail_every`-th request (1-based
    count of arrivals; 0 = never) gets HTTP 500; every `cut_every`-th ends cleanly after half its
    tokens; every `silent_every`-th streams its tokens as empty text, as a server does for tokens
    that decode to nothing (special tokens it skips). `buffered` sends the whole stream in one piece
    at the end, like a buffering proxy.
    `keep_alive_s`: how long an idle connection stays open (uvicorn's default, as vLLM's server).

    The waits are asyncio sleeps, and the event loop waits on epoll in whole milliseconds, so a chunk
    goes out up to ~1 ms late and the absolute schedule shortens the gap after it: at `itl_s` of a few
    ms the gaps fall in two clusters ~1 ms apart, and their median can land in either. Where a test
    compares ITL or TTFT medians against a limit of a few percent, give times of tens of ms (several
    with several `tokens_per_chunk` to keep the tokens/s)."""

    ttft_s: float = 0.0
    itl_s: float = 0.0
    slots: int = 1024
    tokens_per_chunk: int = 1
    fail_every: int = 0
    cut_every: int = 0
    silent_every: int = 0
    buffered: bool = False
    send_usage: bool = True
    model: str = "fake-model"
    keep_alive_s: float = 5.0


def create_app(config: FakeServerConfig) -> Starlette:
    slots = asyncio.Semaphore(config.slots)
    arrivals = 0

    async def completions(request: Request) -> Response:
        return await stream(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await stream(request, chat=True)

    async def stream(request: Request, chat: bool) -> Response:
        nonlocal arrivals
        arrivals += 1
        number = arrivals
        body = await request.json()
        if config.fail_every and number % config.fail_every == 0:
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        budget = int(body.get("max_tokens", 16))
        if config.cut_every and number % config.cut_every == 0:
            budget = budget // 2
        if chat:  # whitespace words of every message stand in for tokens, as for a text prompt
            prompt_tokens = sum(len(str(m.get("content", "")).split()) for m in body.get("messages") or [])
        else:
            prompt = body.get("prompt", "")
            prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt).split())
        include_usage = config.send_usage and (body.get("stream_options") or {}).get("include_usage")
        events = _events(config, slots, number, budget, prompt_tokens, bool(include_usage), chat)
        if config.buffered:
            events = _buffer(events)
        return StreamingResponse(events, media_type="text/event-stream")

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": config.model, "object": "model"}]})

    async def version(request: Request) -> Response:
        return JSONResponse(
            {"name": "fake-server", "version": "0", "model": config.model, "config": asdict(config)}
        )

    async def health(request: Request) -> Response:
        return JSONResponse({})

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models),
        Route("/version", version),
        Route("/health", health),
    ]
    return Starlette(routes=routes)


async def _events(
    config: FakeServerConfig,
    slots: asyncio.Semaphore,
    number: int,
    budget: int,
    prompt_tokens: int,
    include_usage: bool,
    chat: bool = False,
) -> AsyncIterator[bytes]:
    """A completion's chunks, or a chat completion's as this project's server sends them: the role
    alone at once, then one content delta per chunk, then an empty delta with the finish reason."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    silent = config.silent_every > 0 and number % config.silent_every == 0
    if chat:
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        yield _chunk(number, kind, config.model, role)
    async with slots:
        start = time.monotonic()
        sent = 0
        chunk_index = 0
        while sent < budget:
            due = start + config.ttft_s + chunk_index * config.itl_s
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            count = min(config.tokens_per_chunk, budget - sent)
            text = "" if silent else " x" * count
            content = {"delta": {"content": text}} if chat else {"text": text}
            yield _chunk(number, kind, config.model, {"index": 0, **content, "finish_reason": None})
            sent += count
            chunk_index += 1
        if chat:
            yield _chunk(number, kind, config.model, {"index": 0, "delta": {}, "finish_reason": "length"})
        if include_usage:
            usage = {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": sent,
                "total_tokens": prompt_tokens + sent,
            }
            yield (
                b"data: "
                + json.dumps({"id": f"cmpl-{number}", "choices": [], "usage": usage}).encode()
                + b"\n\n"
            )
        yield b"data: [DONE]\n\n"


def _chunk(number: int, kind: str, model: str, choice: dict[str, Any]) -> bytes:
    body = {"id": f"cmpl-{number}", "object": kind, "model": model, "choices": [choice]}
    return b"data: " + json.dumps(body).encode() + b"\n\n"


async def _buffer(events: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    yield b"".join([event async for event in events])


def _bound_socket(port: int = 0) -> socket.socket:
    """A socket bound to 127.0.0.1; port 0 lets the OS pick a free one."""
    # proto must say TCP: asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and
    # without it a keep-alive response waits ~40 ms for a delayed ACK (Nagle).
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def _uvicorn_config(config: FakeServerConfig) -> uvicorn.Config:
    # uvicorn annotates the keep-alive as int but schedules it with loop.call_later, which takes a float
    keep_alive: Any = config.keep_alive_s
    return uvicorn.Config(
        create_app(config), log_level="warning", lifespan="off", timeout_keep_alive=keep_alive
    )


class FakeServerThread:
    """Context manager: the app under uvicorn in a background thread of this process; `.base_url`."""

    def __init__(self, config: FakeServerConfig) -> None:
        self.config = config
        self.base_url = ""
        self._sock = _bound_socket()
        uv_config = _uvicorn_config(config)
        self._server = uvicorn.Server(uv_config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True
        )

    def __enter__(self) -> FakeServerThread:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        self.base_url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/v1"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()


class FakeServerProcess:
    """Context manager: the app in its own Python process (so it does not share a core or the GIL
    with the client being measured); `.base_url`."""

    def __init__(self, config: FakeServerConfig) -> None:
        self.config = config
        self.base_url = ""
        self._process: subprocess.Popen[str] | None = None

    def __enter__(self) -> FakeServerProcess:
        args = [sys.executable, "-m", "bench.fake_server", "--port", "0"]
        for f in fields(FakeServerConfig):
            value = getattr(self.config, f.name)
            if isinstance(value, bool):
                args += [f"--{'' if value else 'no-'}{f.name.replace('_', '-')}"]
            else:
                args += [f"--{f.name.replace('_', '-')}", str(value)]
        self._process = subprocess.Popen(args, stdout=subprocess.PIPE, text=True)
        assert self._process.stdout is not None
        line = self._process.stdout.readline()  # "listening on http://127.0.0.1:PORT/v1"
        if not line.startswith("listening on "):
            self._process.kill()
            raise RuntimeError(f"fake server did not start: {line!r}")
        self.base_url = line.split()[-1]
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._process is not None
        self._process.terminate()
        self._process.wait(timeout=10)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.fake_server", description=__doc__)
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    for f in fields(FakeServerConfig):
        flag = f"--{f.name.replace('_', '-')}"
        if f.type == "bool":
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            caster = {"float": float, "int": int, "str": str}[str(f.type)]
            parser.add_argument(flag, dest=f.name, type=caster, default=f.default)
    args = parser.parse_args(argv)
    config = FakeServerConfig(**{f.name: getattr(args, f.name) for f in fields(FakeServerConfig)})
    sock = _bound_socket(args.port)
    sock.listen(2048)  # connections made before uvicorn is up wait in the backlog instead of failing
    print(f"listening on http://127.0.0.1:{sock.getsockname()[1]}/v1", flush=True)
    uvicorn.Server(_uvicorn_config(config)).run(sockets=[sock])


if __name__ == "__main__":
    main()

"""Helpers of the server tests: a live uvicorn in a thread, `python -m server` as a subprocess (the
black-box tests), SSE and Prometheus text parsing.

Imported by conftest.py and the test modules (pytest puts this folder on sys.path).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from bench.host_cost import child_pids
from engine.core_process import CoreProcess
from server import create_app

# Small and fast on two CPU cores: 64 blocks of 16 tokens hold two full 512-token contexts.
ENGINE_OPTIONS: dict[str, Any] = {"max_model_len": 512, "num_kv_blocks": 64, "block_size": 16, "seed": 0}
MODEL_NAME = "tiny"


@asynccontextmanager
async def app_client(core: CoreProcess, **app_options: Any) -> AsyncIterator[httpx.AsyncClient]:
    """create_app(core, ...) driven in-process through httpx's ASGITransport, its lifespan running
    (connected to the engine core, drained at the end); no incremental streaming."""
    app = create_app(core, MODEL_NAME, **{"shutdown_timeout": 2.0, **app_options})
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
            yield client


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line")


def fail_to_add_66_66_66() -> None:
    """A core setup (runs in the engine core's process): adding the prompt [66, 66, 66] raises a
    RuntimeError, an engine failure rather than a bad request."""
    from engine import LLMEngine

    real_add = LLMEngine.add_request

    def add_request(self: LLMEngine, request_id: str, prompt: Any, *args: Any, **kwargs: Any) -> None:
        if list(prompt) == [66, 66, 66]:
            raise RuntimeError("boom")
        real_add(self, request_id, prompt, *args, **kwargs)

    LLMEngine.add_request = add_request  # type: ignore[method-assign]


class LiveServer:
    """uvicorn serving create_app(core, ...) on 127.0.0.1:<free port> in a background thread."""

    def __init__(self, core: CoreProcess, **app_options: Any) -> None:
        self.app = create_app(core, MODEL_NAME, **{"shutdown_timeout": 2.0, **app_options})
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=3
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="test-uvicorn", daemon=True)

    def __enter__(self) -> str:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}"

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(15)


REPO_ROOT = Path(__file__).resolve().parents[3]
CORE_PID = re.compile(r"\[core pid=(\d+)\]")
API_PID = re.compile(r"\[api \d+ pid=(\d+)\]")
READY = re.compile(r"ready: serving .* at (http://127\.0\.0\.1:\d+)")
# The defaults of a server process; flags given to ServerProcess come later, so they win (argparse).
PROCESS_FLAGS = (
    "--port",
    "0",
    "--max-model-len",
    "512",
    "--num-kv-blocks",
    "64",
    "--served-model-name",
    "tiny",
)


class ServerProcess:
    """`python -m server --model DIR ...` on 127.0.0.1:<free port>, its output in `log_path`."""

    def __init__(
        self, model_dir: Path, log_path: Path, *flags: str, env: dict[str, str] | None = None
    ) -> None:
        command = [sys.executable, "-m", "server", "--model", str(model_dir), *PROCESS_FLAGS, *flags]
        self.log_path = log_path
        self.log = log_path.open("w")
        self.process = subprocess.Popen(
            command,
            cwd=REPO_ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.url = self._wait_ready()

    def _wait_ready(self, timeout: float = 180) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = READY.search(self.log_path.read_text())
            if match:
                return match.group(1)
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        self.close()
        raise AssertionError(f"no ready line; log:\n{self.log_path.read_text()}")

    def rss_bytes(self) -> int:
        """Resident set size of the server's processes, the API process and its engine core (Linux
        /proc)."""
        return sum(_rss_bytes(pid) for pid in [self.process.pid, *child_pids(self.process.pid)])

    def core_pid(self) -> int:
        """The engine core's process, as its log lines name it."""
        [pid] = {int(pid) for pid in CORE_PID.findall(self.log_text())}
        return pid

    def api_pids(self) -> list[int]:
        """The API processes of `--api-server-count N` (N > 1), as their log lines name them."""
        return sorted({int(pid) for pid in API_PID.findall(self.log_text())})

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)
        self.log.close()


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text to {sample name with labels: value}."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


async def metric(client: httpx.AsyncClient, name: str) -> float:
    response = await client.get("/metrics")
    return parse_metrics(response.text)[name]


async def wait_for_metric(
    client: httpx.AsyncClient, name: str, predicate: Callable[[float], bool], timeout: float = 5.0
) -> float:
    deadline = time.monotonic() + timeout
    while True:
        value = await metric(client, name)
        if predicate(value) or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


def sse_payloads(body: str) -> list[Any]:
    """The `data:` payloads of an SSE body, JSON-decoded except the final "[DONE]"."""
    payloads: list[Any] = []
    for line in body.splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            payloads.append(data if data == "[DONE]" else json.loads(data))
    return payloads


@asynccontextmanager
async def streaming(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> AsyncIterator[httpx.Response]:
    async with client.stream("POST", path, json=body) as response:
        yield response

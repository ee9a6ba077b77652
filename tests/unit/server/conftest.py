"""Fixtures for the server tests: one tiny engine core process per session (shared by every app, as
several API processes share one core), the app behind httpx, live servers.

`api` drives the app in-process through httpx's ASGITransport (no incremental streaming);
`live_server` runs a real uvicorn on 127.0.0.1 in a thread, for streaming, disconnect and admission
tests; `start_server` runs `python -m server` as a subprocess, for the black-box tests. The model folder comes from the top-level `tiny_model_dir` fixture.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_testing import ENGINE_OPTIONS, LiveServer, ServerProcess, app_client

from engine import EngineArgs
from engine.core_process import CoreProcess
from server.app import load_tokenizer


@pytest.fixture(scope="session")
def core(tiny_model_dir: Path) -> Iterator[CoreProcess]:
    """Shared by every app in the session; each app's lifespan leaves it idle again."""
    core = CoreProcess.launch(EngineArgs(model=str(tiny_model_dir), **ENGINE_OPTIONS))
    yield core
    core.shutdown()


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture
async def api(core: CoreProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with app_client(core, max_pending=64) as client:
        yield client


@pytest.fixture
def live_server(core: CoreProcess) -> Iterator[Callable[..., LiveServer]]:
    """Factory: `with live_server(max_pending=2) as url:`."""
    yield lambda **options: LiveServer(core, **options)


@pytest.fixture
def start_server(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """Factory: `start_server("--max-pending", "4", env={...})`; every server is killed afterwards."""
    started: list[ServerProcess] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> ServerProcess:
        server = ServerProcess(tiny_model_dir, tmp_path / f"server-{len(started)}.log", *flags, env=env)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "soak: long soak test of the server, run on demand with -m soak")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`soak` tests run only when selected (`-m soak`), never in the default run."""
    if "soak" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="on demand: pytest -m soak")
    for item in items:
        if "soak" in item.keywords:
            item.add_marker(skip)

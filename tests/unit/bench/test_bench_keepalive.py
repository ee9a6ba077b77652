"""The load generator never sends a request on a connection the server is closing.

uvicorn (behind our server and vLLM's) closes a keep-alive connection after it has been idle for
`timeout_keep_alive`; a request written at that instant is reset without reaching the application.
Bursts of requests spaced by exactly that idle time hit the race often with the httpx transport bench
used before (`ReadError('')`, dozens in a thousand requests with httpx's default 5-s expiry against a
5-s server); the client drops idle connections before the server would.
"""

from __future__ import annotations

import asyncio

import aiohttp
import uvicorn

from bench import client
from bench.client import Endpoint, make_http_client, request_body
from bench.fake_server import FakeServerConfig, FakeServerThread, create_app
from bench.workload import WorkloadSpec, make_request

SERVER_KEEP_ALIVE_S = 0.2


async def bursts(endpoint: Endpoint, count: int, size: int, gap_s: float) -> list[str]:
    errors: list[str] = []
    body = request_body(
        endpoint.model, make_request(WorkloadSpec(kind="fixed", input_len=4, output_len=2), 0)
    )
    async with make_http_client(endpoint) as http:

        async def one() -> None:
            try:
                async with http.post(f"{endpoint.base_url}/completions", json=body) as response:
                    await response.read()
            except aiohttp.ClientError as exc:
                errors.append(repr(exc))

        for _ in range(count):
            await asyncio.gather(*(one() for _ in range(size)))
            await asyncio.sleep(gap_s)
    return errors


def test_requests_spaced_by_the_servers_keep_alive_are_never_reset(monkeypatch):
    # Scaled down so the test takes seconds: the server closes after 0.2 s idle, the client after half that.
    monkeypatch.setattr(client, "KEEPALIVE_EXPIRY_S", SERVER_KEEP_ALIVE_S / 2)
    with FakeServerThread(FakeServerConfig(keep_alive_s=SERVER_KEEP_ALIVE_S)) as fake:
        endpoint = Endpoint(fake.base_url, "fake-model")
        errors = asyncio.run(bursts(endpoint, count=60, size=20, gap_s=SERVER_KEEP_ALIVE_S))
    assert errors == []


def test_the_client_lets_go_before_uvicorns_default_keep_alive():
    default = uvicorn.Config(create_app(FakeServerConfig())).timeout_keep_alive
    assert default > client.KEEPALIVE_EXPIRY_S

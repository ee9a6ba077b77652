"""Soak: many short requests through a real `python -m server` process, its memory read from /metrics.

The server runs with PAGED_ENGINE_TRACEMALLOC=1, so /metrics carries the Python heap as tracemalloc counts
it (after a full collection: without one, cyclic garbage made it swing by ±0.4 MiB with the collector's
timing, while after one it stayed at 1.08-1.11 MiB over 5,000 requests) beside the process RSS. `test_soak_short` (in CI, 1,000 requests, ~25 s) asserts that the heap does not
grow with the request count; `test_soak` (marked `soak`, on demand: `pytest -m soak -s
tests/unit/server/test_server_soak.py`, 20,000 requests, ~8 minutes on 2 cores) also asserts that RSS
flattens: the second half adds less than a quarter of what the first half added.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
from raw_http import request
from server_testing import ServerProcess, parse_metrics

CONCURRENCY = 8
WARMUP_REQUESTS = 300
MiB = 1 << 20


async def memory(url: str) -> tuple[float, float]:
    """(RSS, traced Python heap) in bytes."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        metrics = parse_metrics((await client.get("/metrics")).text)
    return metrics["process_resident_memory_bytes"], metrics["server_python_heap_traced_bytes"]


async def run_requests(url: str, count: int, first_index: int) -> None:
    """`count` short requests, CONCURRENCY at a time; streaming and not, completions and chat."""
    next_index = first_index

    async def worker() -> None:
        nonlocal next_index
        while next_index < first_index + count:
            index = next_index
            next_index += 1
            if index % 4 == 3:
                path = "/v1/chat/completions"
                body: dict = {"messages": [{"role": "user", "content": f"hello {index}"}]}
            else:
                path = "/v1/completions"
                body = {"prompt": [1 + index % 1000, 2, 3]}
            body.update({"max_tokens": 2, "ignore_eos": True, "stream": index % 2 == 0, "seed": index})
            answer = await request(url, path, body)
            assert answer.status == 200, answer.body

    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))


async def soak(server: ServerProcess, total: int, samples: int) -> list[tuple[int, float, float]]:
    """Warm up, then `total` requests; (requests done, RSS, heap) at `samples` + 1 points."""
    await run_requests(server.url, WARMUP_REQUESTS, 0)
    points = [(0, *(await memory(server.url)))]
    step = total // samples
    start = time.monotonic()
    for done in range(step, total + 1, step):
        await run_requests(server.url, step, WARMUP_REQUESTS + done - step)
        points.append((done, *(await memory(server.url))))
    elapsed = time.monotonic() - start
    print(f"\nsoak: {total} requests in {elapsed:.0f} s ({total / elapsed:.0f}/s)")
    for done, rss, heap in points:
        print(f"  {done:>6} requests: RSS {rss / MiB:7.1f} MiB, Python heap {heap / MiB:6.2f} MiB")
    return points


def start_soak_server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server("--disable-uvicorn-access-log", env={"PAGED_ENGINE_TRACEMALLOC": "1"})


async def blocks_left(url: str) -> dict[str, float]:
    """The KV blocks in use (must be 0 once every request has finished) and kept by the prefix cache."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        metrics = parse_metrics((await client.get("/metrics")).text)
    return {name: metrics[name] for name in ("engine_kv_blocks_used", "engine_kv_blocks_cached")}


async def test_soak_short(start_server: Callable[..., ServerProcess]) -> None:
    server = start_soak_server(start_server)
    points = await soak(server, 1_000, 4)
    heaps = [heap for _, _, heap in points]
    # The second 500 requests: a leak of 1 kB a request would add 0.5 MiB.
    assert heaps[-1] - heaps[1] < 0.25 * MiB, heaps
    left = await blocks_left(server.url)
    print(f"  afterwards: {left}")
    assert left["engine_kv_blocks_used"] == 0  # prefix caching is on: cached blocks may stay


@pytest.mark.soak
async def test_soak(start_server: Callable[..., ServerProcess]) -> None:
    server = start_soak_server(start_server)
    points = await soak(server, 20_000, 10)
    (_, rss_start, _), (_, rss_mid, heap_mid), (_, rss_end, heap_end) = points[0], points[5], points[-1]
    first, second = rss_mid - rss_start, rss_end - rss_mid
    assert second < max(first / 4, 1 * MiB), (first / MiB, second / MiB)  # 1 MiB: page-level noise
    assert heap_end - heap_mid < 0.25 * MiB, (heap_mid, heap_end)
    assert (await blocks_left(server.url))["engine_kv_blocks_used"] == 0

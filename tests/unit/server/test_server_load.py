"""Overload and disconnect storms against a real `python -m server` process (black box).

Overload: an open-loop burst, requests started on a fixed schedule whatever the answers, at far more
than the server can take with a small --max-pending. Every accepted request must finish whole,
refusals must be quick 503s with Retry-After, and the server must be idle again soon after.

Disconnect storm: streaming requests, each dropped by its client at a random point (before the
answer, after its head, mid-stream, right at the end); afterwards nothing may be left in the engine.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from raw_http import Answer, Connection, request
from server_testing import ServerProcess, parse_metrics

COMPLETIONS = "/v1/completions"
BURST_SECONDS = 3.0
BURST_RATE = 100.0  # requests started per second
OVERLOAD_MAX_TOKENS = 32
STORM_REQUESTS = 1_000
STORM_CONCURRENCY = 100
STORM_MAX_TOKENS = 8
# Storm prompts start with 0, 1, 1.5 or 2 blocks (of 16) of this, so dropped requests share cached and
# in-use prefix blocks: disconnects must drop only their own references.
STORM_PREFIX = [31_000 + i for i in range(32)]
# Deadlines, not speeds. One API process refuses before the request reaches the engine core (under
# 10 ms at p99 on 2 cores); one that waited for the engine's steps would take a share of a 32-token
# request. With two, a process that is under the limit itself asks the core, which holds the limit
# over both and answers between two steps: the step under way (up to ~0.5 s for the tiny model's CPU
# steps on a busy 2-core machine), not the request's.
REFUSAL_DEADLINE_S = {"1": 0.25, "2": 2.0}


async def wait_idle(url: str, timeout: float = 5.0) -> dict[str, float]:
    """/metrics once KV blocks, running, waiting and pending are all 0 (or at the timeout)."""
    names = (
        "engine_kv_blocks_used",
        "engine_requests_running",
        "engine_requests_waiting",
        "server_requests_pending",
    )
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while True:
            metrics = parse_metrics((await client.get("/metrics")).text)
            if all(metrics[name] == 0 for name in names) or time.monotonic() > deadline:
                return {name: metrics[name] for name in names}
            await asyncio.sleep(0.05)


async def still_answers(url: str) -> None:
    answer = await request(url, COMPLETIONS, {"prompt": [1, 2, 3], "max_tokens": 3, "ignore_eos": True})
    assert answer.status == 200
    assert json.loads(answer.body)["usage"]["completion_tokens"] == 3


async def one_overload_request(url: str, index: int, rng: random.Random) -> tuple[Answer, float]:
    stream = index % 2 == 0
    body = {
        "prompt": [rng.randrange(32_000) for _ in range(rng.randint(1, 20))],
        "max_tokens": OVERLOAD_MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 1.0,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }
    start = time.monotonic()
    connection = await Connection.post(url, COMPLETIONS, body)
    try:
        answer = await connection.head()
        head_s = time.monotonic() - start
        return await connection.body(answer), head_s
    finally:
        await connection.close()


def generated_tokens(answer: Answer) -> int:
    if answer.events:
        assert answer.events[-1] == "[DONE]"
        finals = [e for e in answer.events[:-1] if e["choices"] and e["choices"][0]["finish_reason"]]
        assert len(finals) == 1 and finals[0]["choices"][0]["finish_reason"] == "length", answer.events[-3:]
        # an event per step, or fewer carrying several tokens when the server fell behind: count usage's
        usage = answer.events[-2]
        assert usage["choices"] == [] and len(answer.events) - 2 <= usage["usage"]["completion_tokens"]
        return int(usage["usage"]["completion_tokens"])
    body = json.loads(answer.body)
    assert body["choices"][0]["finish_reason"] == "length"
    return int(body["usage"]["completion_tokens"])


# One API process, and two in front of the one core (the limit then held over both, in the core).
API_PROCESSES = pytest.mark.parametrize("api_processes", ["1", "2"], ids=["1 API process", "2 API processes"])


@API_PROCESSES
async def test_overload_burst(start_server: Callable[..., ServerProcess], api_processes: str) -> None:
    server = start_server(
        "--api-server-count",
        api_processes,
        "--max-pending",
        "4",
        "--max-model-len",
        "128",
        "--num-kv-blocks",
        "32",
        "--disable-uvicorn-access-log",
    )
    rng = random.Random(0)
    tasks = []
    start = time.monotonic()
    index = 0
    while (now := time.monotonic() - start) < BURST_SECONDS:  # open loop: on schedule, whatever answers
        while index < BURST_RATE * now:
            tasks.append(asyncio.create_task(one_overload_request(server.url, index, rng)))
            index += 1
        await asyncio.sleep(0.002)
    offered_s = time.monotonic() - start
    results = await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    statuses = Counter(answer.status for answer, _ in results)
    assert set(statuses) <= {200, 503}, statuses
    accepted = [answer for answer, _ in results if answer.status == 200]
    refused = [(answer, head_s) for answer, head_s in results if answer.status == 503]
    for answer in accepted:
        assert generated_tokens(answer) == OVERLOAD_MAX_TOKENS
    for answer, _ in refused:
        assert int(answer.headers["retry-after"]) >= 1
        assert b'"type":"ServiceUnavailableError"' in answer.body
    refusal_s = sorted(head_s for _, head_s in refused)
    p99 = refusal_s[int(0.99 * (len(refusal_s) - 1))]
    print(
        f"\noverload: {len(results)} requests in {offered_s:.1f} s, {len(accepted)} accepted, "
        f"{len(refused)} refused; 503 latency p50 {statistics.median(refusal_s) * 1000:.1f} ms, "
        f"p99 {p99 * 1000:.1f} ms"
    )
    assert len(results) >= BURST_RATE * BURST_SECONDS * 0.95
    # An overload: past the --max-pending 4 it took at once, requests were turned away (on 2 cores
    # over 90 % of them; how many depends on the machine's speed, so it is printed, not held).
    assert len(accepted) >= 4 and refused, statuses
    assert p99 < REFUSAL_DEADLINE_S[api_processes]
    assert await wait_idle(server.url) == dict.fromkeys(
        (
            "engine_kv_blocks_used",
            "engine_requests_running",
            "engine_requests_waiting",
            "server_requests_pending",
        ),
        0,
    )
    await still_answers(server.url)


DROP_POINTS = ("before the answer", "after the head", "mid-stream", "at the end")


async def one_dropped_request(url: str, point: str, rng: random.Random) -> int:
    """Returns the number of SSE events read before dropping."""
    shared = STORM_PREFIX[: rng.choice((0, 16, 24, 32))]
    body = {
        "prompt": shared + [rng.randrange(30_000) for _ in range(rng.randint(1, 30))],
        "max_tokens": STORM_MAX_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    connection = await Connection.post(url, COMPLETIONS, body)
    events = 0
    try:
        if point == "before the answer":
            return 0
        answer = await connection.head()
        assert answer.status == 200, answer.status
        if point == "after the head":
            return 0
        stop_after = rng.randint(1, STORM_MAX_TOKENS - 1) if point == "mid-stream" else STORM_MAX_TOKENS
        async for chunk in connection.chunks():
            events += chunk.count(b"data: ")
            if events >= stop_after:  # at the end: the last token read, [DONE] not
                return events
        return events
    finally:
        connection.drop()


@API_PROCESSES
async def test_disconnect_storm(start_server: Callable[..., ServerProcess], api_processes: str) -> None:
    server = start_server(
        "--api-server-count",
        api_processes,
        "--max-model-len",
        "128",
        "--num-kv-blocks",
        "128",
        "--disable-uvicorn-access-log",
    )
    rng = random.Random(1)
    points = [DROP_POINTS[i % len(DROP_POINTS)] for i in range(STORM_REQUESTS)]
    rng.shuffle(points)
    gate = asyncio.Semaphore(STORM_CONCURRENCY)

    async def run(point: str) -> int:
        async with gate:
            return await one_dropped_request(server.url, point, rng)

    start = time.monotonic()
    events = await asyncio.wait_for(asyncio.gather(*(run(point) for point in points)), timeout=120)
    elapsed = time.monotonic() - start
    mid = [n for n, point in zip(events, points, strict=True) if point == "mid-stream"]
    assert all(1 <= n < STORM_MAX_TOKENS for n in mid)
    idle = await wait_idle(server.url)
    print(f"\ndisconnect storm: {STORM_REQUESTS} requests dropped in {elapsed:.1f} s; afterwards {idle}")
    assert idle == dict.fromkeys(idle, 0)  # no block used; cached ones may stay
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as client:
        metrics = parse_metrics((await client.get("/metrics")).text)
    assert metrics["engine_prefix_cache_hits_total"] > 0  # the shared prefixes were shared
    await still_answers(server.url)
    log = server.log_text()
    assert "Traceback" not in log, log[-3000:]

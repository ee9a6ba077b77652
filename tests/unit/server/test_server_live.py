"""Against a real uvicorn on 127.0.0.1 (in a thread): events arrive while the request is still
generating, a client that disconnects gets its KV blocks freed, admission control at the limit, and
the official openai client (completions and chat, streaming and not).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from server_testing import MODEL_NAME, LiveServer, metric, wait_for_metric

LONG = {"prompt": [5, 6, 7, 8], "max_tokens": 400, "ignore_eos": True, "stream": True}  # ~2 s on CPU


class Events:
    """SSE events of a streaming httpx response, read one at a time or to the end."""

    def __init__(self, response: httpx.Response) -> None:
        self._lines = response.aiter_lines()

    async def next(self) -> Any:
        async for line in self._lines:
            if line.startswith("data: "):
                data = line[len("data: ") :]
                return data if data == "[DONE]" else json.loads(data)
        raise AssertionError("the stream ended without an event")

    async def rest(self) -> list[Any]:
        events = []
        while not events or events[-1] != "[DONE]":
            events.append(await self.next())
        return events


async def test_first_event_arrives_while_generating(live_server: Callable[..., LiveServer]) -> None:
    with live_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json={**LONG, "max_tokens": 100}) as response:
                events = Events(response)
                first = await events.next()
                assert first["choices"][0]["finish_reason"] is None
                # The first token is in our hands and the request is still running in the engine.
                assert await metric(client, "engine_requests_running") == 1
                rest = await events.rest()
            assert rest[-1] == "[DONE]" and rest[-2]["choices"][0]["finish_reason"] == "length"
            # an event per step (the first, then the rest but [DONE]), fewer if some went out as one
            assert 1 + len(rest) - 1 <= 100


async def test_disconnect_aborts_and_frees_blocks(live_server: Callable[..., LiveServer]) -> None:
    with live_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json=LONG) as response:
                await Events(response).next()
                assert await metric(client, "engine_kv_blocks_used") > 0
            # Leaving the block closed the connection mid-stream.
            assert await wait_for_metric(client, "engine_kv_blocks_used", lambda v: v == 0, timeout=3) == 0
            assert await metric(client, "engine_requests_running") == 0
            assert await metric(client, 'engine_request_success_total{finished_reason="abort"}') == 1
            assert await metric(client, "server_requests_pending") == 0


async def test_disconnect_of_a_non_streaming_request_aborts_it(
    live_server: Callable[..., LiveServer],
) -> None:
    with live_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {**LONG, "stream": False}
            task = asyncio.create_task(client.post("/v1/completions", json=body))
            await wait_for_metric(client, "engine_kv_blocks_used", lambda v: v > 0)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert await wait_for_metric(client, "engine_kv_blocks_used", lambda v: v == 0, timeout=3) == 0


async def test_admission_at_the_limit(live_server: Callable[..., LiveServer]) -> None:
    with live_server(max_pending=2) as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            long = {**LONG, "max_tokens": 200}
            async with (
                client.stream("POST", "/v1/completions", json=long) as first,
                client.stream("POST", "/v1/completions", json=long) as second,
            ):
                first_events, second_events = Events(first), Events(second)
                await first_events.next()
                await second_events.next()
                refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                assert refused.status_code == 503
                assert int(refused.headers["retry-after"]) >= 1
                error = refused.json()["error"]
                assert (
                    error["type"] == "ServiceUnavailableError"
                    and error["code"] == 503
                    and "pending" in error["message"]
                )
                # A batch counts once per prompt, chat like a completion.
                chat = await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
                assert chat.status_code == 503
                results = await asyncio.gather(first_events.rest(), second_events.rest())
            for events in results:
                assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
            assert await metric(client, "server_requests_rejected_total") == 2
            batch = await client.post("/v1/completions", json={"prompt": [[1], [2]], "max_tokens": 1})
            assert batch.status_code == 200
            # A batch that could never fit, even on this idle server, is the client's error: 400, not 503.
            too_big = await client.post("/v1/completions", json={"prompt": [[1], [2], [3]], "max_tokens": 1})
            assert too_big.status_code == 400 and "retry-after" not in too_big.headers
            error = too_big.json()["error"]
            assert error["param"] == "prompt" and "--max-pending" in error["message"]
            assert await metric(client, "server_requests_rejected_total") == 2


@pytest.fixture
def openai_client(live_server: Callable[..., LiveServer]) -> Any:
    with live_server() as url:
        yield openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


async def test_openai_client_completions(openai_client: openai.AsyncOpenAI) -> None:
    completion = await openai_client.completions.create(
        model=MODEL_NAME, prompt="once upon", max_tokens=5, temperature=0, extra_body={"ignore_eos": True}
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    stream = await openai_client.completions.create(
        model=MODEL_NAME,
        prompt="once upon",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == completion.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == completion.usage.total_tokens


async def test_openai_client_chat(openai_client: openai.AsyncOpenAI) -> None:
    messages: Any = [{"role": "user", "content": "say something"}]
    chat = await openai_client.chat.completions.create(
        model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert chat.choices[0].message.role == "assistant" and chat.choices[0].finish_reason == "length"
    stream = await openai_client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=4,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_openai_client_errors(openai_client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        await openai_client.completions.create(model=MODEL_NAME, prompt="hi", max_tokens=0)
    assert bad.value.body is not None and bad.value.body["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(openai.NotFoundError):
        await openai_client.completions.create(model="nope", prompt="hi")
    models = await openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


async def test_a_server_that_falls_behind_sends_several_tokens_a_chunk(
    live_server: Callable[..., LiveServer],
) -> None:
    server = live_server()
    with server as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            greedy = {**LONG, "max_tokens": 120, "temperature": 0}
            body = {**greedy, "stream_options": {"include_usage": True}}
            async with client.stream("POST", "/v1/completions", json=body) as response:
                events = Events(response)
                first = await events.next()
                # Hold the server's event loop while the engine thread goes on stepping.
                loop = server.app.state.async_engine._loop
                loop.call_soon_threadsafe(time.sleep, 0.5)
                rest = await events.rest()
            expected = await client.post("/v1/completions", json={**greedy, "stream": False})
    usage, chunks = rest[-2]["usage"], [first, *rest[:-2]]
    assert usage["completion_tokens"] == 120
    assert len(chunks) < 120  # the steps run during the hold went out together
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected.json()["choices"][0]["text"]
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "length"]

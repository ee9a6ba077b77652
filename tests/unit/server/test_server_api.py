"""The HTTP API through httpx against the app in-process: response shapes, exact usage, streaming
format, the info endpoints, greedy equality with the offline API, and the engine loop surviving a
request that fails inside it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from server_testing import (
    ENGINE_OPTIONS,
    MODEL_NAME,
    app_client,
    fail_to_add_66_66_66,
    parse_metrics,
    sse_payloads,
)

from engine import LLM, EngineArgs, SamplingParams
from engine.core_process import CoreProcess
from server.app import render_chat
from server.protocol import ChatMessage


async def complete(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    response = await client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


async def test_completion_shape_and_exact_usage(api: httpx.AsyncClient, tokenizer: Any) -> None:
    prompt = "the quick brown fox"
    body = await complete(api, model=MODEL_NAME, prompt=prompt, max_tokens=7, ignore_eos=True, temperature=0)
    assert (
        body["object"] == "text_completion" and body["model"] == MODEL_NAME and body["id"].startswith("cmpl-")
    )
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    num_prompt = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 7,
        "total_tokens": num_prompt + 7,
    }


async def test_token_id_prompt_and_batches(api: httpx.AsyncClient) -> None:
    body = await complete(api, prompt=[5, 6, 7], max_tokens=3, ignore_eos=True)
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}

    body = await complete(api, prompt=[[5, 6], [7, 8, 9], [10]], max_tokens=2, ignore_eos=True)
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert body["usage"] == {"prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12}

    body = await complete(api, prompt=["a b", "c d e"], max_tokens=2, ignore_eos=True, temperature=0)
    assert len(body["choices"]) == 2 and body["usage"]["completion_tokens"] == 4


async def test_unknown_fields_are_ignored(api: httpx.AsyncClient) -> None:
    body = await complete(api, prompt=[1, 2], max_tokens=1, some_future_field={"x": 1}, user="u")
    assert body["usage"]["completion_tokens"] == 1


async def test_stop_string_and_seed(api: httpx.AsyncClient) -> None:
    first = await complete(api, prompt="hello", max_tokens=8, seed=7, temperature=1.0, ignore_eos=True)
    again = await complete(api, prompt="hello", max_tokens=8, seed=7, temperature=1.0, ignore_eos=True)
    assert first["choices"][0]["text"] == again["choices"][0]["text"]
    text = first["choices"][0]["text"]
    stop = text.split()[1]  # a word the model will produce, so generation stops before it
    stopped = await complete(
        api, prompt="hello", max_tokens=8, seed=7, temperature=1.0, ignore_eos=True, stop=[stop]
    )
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]


async def test_streaming_completion_events(api: httpx.AsyncClient) -> None:
    body = {
        "prompt": [3, 4, 5, 6],
        "max_tokens": 5,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await api.post("/v1/completions", json=body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    chunks, usage_chunk = events[:-2], events[-2]
    # one event per engine step, one token each; steps the event loop had not sent yet go out as one
    assert 1 <= len(chunks) <= 5
    assert all(c["object"] == "text_completion" and c["choices"][0]["index"] == 0 for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == {
        "prompt_tokens": 4,
        "completion_tokens": 5,
        "total_tokens": 9,
    }
    assert len({c["id"] for c in events[:-1]}) == 1


async def test_streaming_without_usage_has_no_usage_chunk(api: httpx.AsyncClient) -> None:
    response = await api.post(
        "/v1/completions", json={"prompt": [3, 4], "max_tokens": 2, "ignore_eos": True, "stream": True}
    )
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]" and all(e["choices"] for e in events[:-1])


async def test_chat_completion(api: httpx.AsyncClient, tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    response = await api.post(
        "/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "ignore_eos": True}
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    num_prompt = len(tokenizer.encode(rendered, add_special_tokens=False))
    assert body["usage"] == {
        "prompt_tokens": num_prompt,
        "completion_tokens": 4,
        "total_tokens": num_prompt + 4,
    }


async def test_chat_streaming_deltas(api: httpx.AsyncClient) -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 3,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await api.post("/v1/chat/completions", json=body)
    events = sse_payloads(response.text)
    assert events[-1] == "[DONE]"
    assert all(e["object"] == "chat.completion.chunk" for e in events[:-1])
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = events[1:-2]  # a delta per step; steps the event loop had not sent yet go out as one
    assert 1 <= len(content) <= 3 and all("content" in e["choices"][0]["delta"] for e in content)
    assert [e["choices"][0]["finish_reason"] for e in content] == [None] * (len(content) - 1) + ["length"]
    assert events[-2]["usage"]["completion_tokens"] == 3


async def test_chat_default_max_tokens_fills_the_context(api: httpx.AsyncClient, tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "x " * 450}]  # ~470 of the 512 tokens: a short reply
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    num_prompt = len(tokenizer.encode(rendered, add_special_tokens=False))
    response = await api.post("/v1/chat/completions", json={"messages": messages, "ignore_eos": True})
    assert 0 < num_prompt < ENGINE_OPTIONS["max_model_len"]
    assert response.json()["usage"]["completion_tokens"] == ENGINE_OPTIONS["max_model_len"] - num_prompt


def test_plain_chat_default_without_template() -> None:
    class NoTemplate:
        chat_template = None

    messages = [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u")]
    assert render_chat(NoTemplate(), messages) == "system: s\nuser: u\nassistant:"


@pytest.mark.parametrize("prompt", ["the meaning of life is", [11, 12, 13, 14, 15]])
async def test_greedy_matches_offline_api(
    api: httpx.AsyncClient, tiny_model_dir: Path, prompt: str | list[int]
) -> None:
    llm = LLM(str(tiny_model_dir), **ENGINE_OPTIONS)
    [expected] = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    body = await complete(api, prompt=prompt, max_tokens=24, temperature=0, ignore_eos=True)
    assert body["choices"][0]["text"] == expected.text
    streamed = await api.post(
        "/v1/completions",
        json={"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "stream": True},
    )
    assert "".join(e["choices"][0]["text"] for e in sse_payloads(streamed.text)[:-1]) == expected.text


async def test_models_health_version(api: httpx.AsyncClient, core: CoreProcess) -> None:
    models = (await api.get("/v1/models")).json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL_NAME]
    assert models["data"][0]["object"] == "model"
    health = await api.get("/health")
    assert health.status_code == 200
    version = (await api.get("/version")).json()
    assert version["name"] == "paged-engine" and version["model"] == MODEL_NAME
    assert version["device"] == "cpu" and version["gpu"] is None
    assert version["config"] == core.info.config
    assert version["config"]["max_model_len"] == 512 and version["config"]["num_kv_blocks"] == 64


async def test_metrics(api: httpx.AsyncClient) -> None:
    await complete(api, prompt=[1, 2, 3], max_tokens=4, ignore_eos=True)
    response = await api.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    samples = parse_metrics(response.text)
    for gauge in ("engine_requests_running", "engine_requests_waiting", "engine_kv_blocks_used"):
        assert samples[gauge] == 0
    assert samples["engine_kv_blocks_total"] == 64
    assert samples["engine_prompt_tokens_total"] == 3
    assert samples["engine_generation_tokens_total"] == 4
    assert samples["engine_time_to_first_token_seconds_count"] == 1
    assert samples["engine_step_time_seconds_count"] >= 4
    assert samples['engine_request_success_total{finished_reason="length"}'] == 1
    assert "engine_preemptions_total" in samples
    assert "engine_kv_blocks_cached" in samples and "engine_prefix_cache_hits_total" in samples
    assert samples["engine_kernel_compiles_total"] == 0  # on CPU nothing compiles


FIRST_TOKEN_PARTS = (
    "server_request_to_core_seconds",
    "engine_request_queue_time_seconds",
    "engine_request_prefill_time_seconds",
    "server_first_token_delivery_seconds",
)


async def test_the_time_to_first_token_is_split_into_parts_that_add_up_to_it(api: httpx.AsyncClient) -> None:
    for prompt in ([5, 6, 7], [8, 9], list(range(100, 300))):
        await complete(api, prompt=prompt, max_tokens=3, ignore_eos=True)
    samples = parse_metrics((await api.get("/metrics")).text)
    assert samples["engine_time_to_first_token_seconds_count"] == 3
    for name in FIRST_TOKEN_PARTS:
        assert samples[f"{name}_count"] == 3, name
        assert samples[f"{name}_sum"] >= 0, name  # one clock for every process of the host
    parts = sum(samples[f"{name}_sum"] for name in FIRST_TOKEN_PARTS)
    assert parts == pytest.approx(samples["engine_time_to_first_token_seconds_sum"], abs=1e-6)


async def test_a_request_that_waits_for_kv_blocks_shows_in_the_queue_time(api: httpx.AsyncClient) -> None:
    async def queue_and_prefill() -> tuple[float, float]:
        samples = parse_metrics((await api.get("/metrics")).text)
        return (
            samples["engine_request_queue_time_seconds_sum"],
            samples["engine_request_prefill_time_seconds_sum"],
        )

    def prompt(seed: int) -> list[int]:
        return [1_000 + 37 * seed + i for i in range(400)]  # 25 of the 64 KV blocks

    # One after the other: nothing waits, so each request's queue time is less than its prefill (a
    # 400-token prompt's step, and the step its token comes back in).
    for seed in range(3):
        await complete(api, prompt=prompt(seed), max_tokens=2, ignore_eos=True)
    alone_queue, alone_prefill = await queue_and_prefill()
    assert alone_queue < alone_prefill
    # All three at once: two fit (2 x 27 blocks of 64 with their 32 tokens), the third waits until one
    # of them has generated all 32 of its tokens, a queue longer than the three prefills.
    await asyncio.gather(
        *(complete(api, prompt=prompt(seed), max_tokens=32, ignore_eos=True) for seed in range(3, 6))
    )
    queue, prefill = await queue_and_prefill()
    assert queue - alone_queue > prefill - alone_prefill


async def test_a_repeated_prompt_shows_prefix_cache_hits_and_reset_forgets_them(
    api: httpx.AsyncClient,
) -> None:
    async def metrics() -> dict[str, float]:
        return parse_metrics((await api.get("/metrics")).text)

    prompt = [20_000 + 7 * i for i in range(40)]  # two full 16-token blocks and 8 more tokens
    before = await metrics()
    await complete(api, prompt=prompt, max_tokens=2, ignore_eos=True)
    first = await metrics()
    assert first["engine_prefix_cache_queries_total"] - before["engine_prefix_cache_queries_total"] == 40
    assert first["engine_prefix_cache_hits_total"] == before["engine_prefix_cache_hits_total"]
    assert first["engine_kv_blocks_used"] == 0 and first["engine_kv_blocks_cached"] >= 2
    second = await complete(api, prompt=prompt, max_tokens=2, ignore_eos=True)
    after = await metrics()
    assert after["engine_prefix_cache_queries_total"] - first["engine_prefix_cache_queries_total"] == 40
    assert after["engine_prefix_cache_hits_total"] - first["engine_prefix_cache_hits_total"] == 32
    assert second["usage"] == {"prompt_tokens": 40, "completion_tokens": 2, "total_tokens": 42}

    reset = await api.post("/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["freed_blocks"] >= 2
    assert (await metrics())["engine_kv_blocks_cached"] == 0
    await complete(api, prompt=prompt, max_tokens=2, ignore_eos=True)
    assert (await metrics())["engine_prefix_cache_hits_total"] == after["engine_prefix_cache_hits_total"]


@pytest.fixture(scope="module")
def failing_core(tiny_model_dir: Path) -> Iterator[CoreProcess]:
    """A core whose engine raises (not a validation error) when asked to add the prompt [66, 66, 66]."""
    core = CoreProcess.launch(
        EngineArgs(model=str(tiny_model_dir), **ENGINE_OPTIONS), setup=fail_to_add_66_66_66
    )
    yield core
    core.shutdown()


async def test_engine_core_survives_a_failing_request(failing_core: CoreProcess) -> None:
    async with app_client(failing_core) as api:
        failed = await api.post("/v1/completions", json={"prompt": [66, 66, 66], "max_tokens": 2})
        assert failed.status_code == 500 and failed.json()["error"]["type"] == "InternalServerError"
        streamed = await api.post(
            "/v1/completions", json={"prompt": [66, 66, 66], "max_tokens": 2, "stream": True}
        )  # refused before its stream began: an error status, not an error event
        assert (
            streamed.status_code == 500
            and "could not take the request" in streamed.json()["error"]["message"]
        )
        assert (await api.get("/health")).status_code == 200
        body = await complete(api, prompt=[1, 2], max_tokens=2, ignore_eos=True)
        assert body["usage"]["completion_tokens"] == 2

"""Every bad input the issue lists gets a 400 (404 for an unknown model) with an OpenAI-style body
naming the field, never a 422 or a 500, and the server keeps serving afterwards.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from server_testing import ENGINE_OPTIONS, MODEL_NAME, app_client

from engine import EngineArgs
from engine.core_process import CoreProcess

LONG_PROMPT = [7] * 600  # past max_model_len 512 on its own
COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"

# (path, JSON body, expected param)
BAD_REQUESTS: list[tuple[str, Any, str | None]] = [
    # wrong types of known fields
    (COMPLETION, {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    (COMPLETION, {"prompt": "hi", "temperature": "hot"}, "temperature"),
    (COMPLETION, {"prompt": 42}, "prompt"),
    (COMPLETION, {"prompt": [1, "two"]}, "prompt"),
    (COMPLETION, {"prompt": "hi", "stream": "maybe"}, "stream"),
    (COMPLETION, {"prompt": "hi", "stop": 5}, "stop"),
    (COMPLETION, {"prompt": "hi", "stream_options": "yes"}, "stream_options"),
    (COMPLETION, {"max_tokens": 3}, "prompt"),  # missing
    (CHAT, {"messages": "hello"}, "messages"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages"),
    # values the engine refuses
    (COMPLETION, {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    (COMPLETION, {"prompt": "hi", "max_tokens": -5}, "max_tokens"),
    (COMPLETION, {"prompt": "hi", "max_tokens": 600}, "max_tokens"),  # prompt + max_tokens past the context
    (COMPLETION, {"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt"),  # the prompt alone past it
    (COMPLETION, {"prompt": [1, 2, 32000]}, "prompt"),  # outside the vocabulary
    (COMPLETION, {"prompt": [-1]}, "prompt"),
    (COMPLETION, {"prompt": ""}, "prompt"),
    (COMPLETION, {"prompt": []}, "prompt"),
    (COMPLETION, {"prompt": [[1, 2], []]}, "prompt"),
    (COMPLETION, {"prompt": "hi", "temperature": -0.5}, "temperature"),
    (COMPLETION, {"prompt": "hi", "top_p": 0}, "top_p"),
    (COMPLETION, {"prompt": "hi", "top_k": -2}, "top_k"),
    (COMPLETION, {"prompt": "hi", "stop": [""]}, "stop"),
    (COMPLETION, {"prompt": "hi", "seed": 2**64}, "seed"),  # torch cannot take it: it would fail the step
    (COMPLETION, {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    (COMPLETION, {"prompt": [[1]] * 65}, "prompt"),  # a batch larger than max_pending (64) never fits
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    (CHAT, {"messages": [{"role": "user", "content": "x " * 600}]}, "prompt"),
    (CHAT, {"messages": []}, "messages"),
    (COMPLETION, {"prompt": "a\ud800b"}, "prompt"),  # a lone surrogate: the tokenizer raised TypeError
    (COMPLETION, {"prompt": ["ok", "\udfff"]}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "\ud83d"}]}, "messages"),
    # features refused clearly rather than ignored
    (COMPLETION, {"prompt": "hi", "n": 0}, "n"),
    (COMPLETION, {"prompt": "hi", "logprobs": 1}, "logprobs"),
    (COMPLETION, {"prompt": "hi", "echo": True}, "echo"),
    (COMPLETION, {"prompt": "hi", "best_of": 2}, "best_of"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "n": 129}, "n"),
    (CHAT, {"messages": [{"role": "user", "content": "hi"}], "logprobs": True}, "logprobs"),
]


async def post_json(api: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    """JSON as json.dumps writes it: ASCII, so lone surrogates travel as \\u escapes (httpx's json=
    writes UTF-8, which cannot hold them)."""
    content = json.dumps(body).encode()
    return await api.post(path, content=content, headers={"content-type": "application/json"})


def assert_error(response: httpx.Response, status: int, param: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == status and error["message"]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS)
@pytest.mark.parametrize("stream", [False, True])
async def test_bad_request_is_400_naming_the_field(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], param: str, stream: bool
) -> None:
    if stream and "stream" not in body:
        body = {**body, "stream": True}
    response = await post_json(api, path, body)
    assert_error(response, 400, param)
    assert response.json()["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("content", [b'{"prompt": "hi",', b"not json", b"", b"[1, 2]", b'"a string"'])
async def test_bad_json_is_400(api: httpx.AsyncClient, content: bytes) -> None:
    response = await api.post(COMPLETION, content=content, headers={"content-type": "application/json"})
    assert_error(response, 400, None)


@pytest.mark.parametrize("path", [COMPLETION, CHAT])
async def test_unknown_model_is_404(api: httpx.AsyncClient, path: str) -> None:
    body = {"model": "gpt-nothing", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}
    response = await api.post(path, json=body)
    assert_error(response, 404, "model")
    assert response.json()["error"]["type"] == "NotFoundError"
    assert response.json()["error"]["message"] == "The model `gpt-nothing` does not exist."


async def test_unknown_route_and_method(api: httpx.AsyncClient) -> None:
    assert_error(await api.get("/v1/nothing"), 404, None)
    assert_error(await api.get(COMPLETION), 405, None)


async def test_still_serving_after_bad_requests(api: httpx.AsyncClient) -> None:
    for path, body, _ in BAD_REQUESTS:
        await post_json(api, path, body)
    response = await api.post(COMPLETION, json={"prompt": [1, 2], "max_tokens": 2, "ignore_eos": True})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 2
    metrics = (await api.get("/metrics")).text
    assert "engine_kv_blocks_used 0.0" in metrics and "server_requests_pending 0.0" in metrics


@pytest.mark.parametrize("value", [b"NaN", b"Infinity", b"-Infinity"])
async def test_non_finite_temperature_is_400(api: httpx.AsyncClient, value: bytes) -> None:
    """Python's JSON parser takes these (not JSON, but sent by some clients); NaN would fail the step."""
    content = b'{"prompt": "hi", "max_tokens": 2, "temperature": ' + value + b"}"
    response = await api.post(COMPLETION, content=content, headers={"content-type": "application/json"})
    assert_error(response, 400, "temperature")


CHAT_BODY = {"messages": [{"role": "user", "content": "hi"}]}
# (path, field, value, words of the message): what the engine cannot honour is refused, never ignored.
# (The penalties and min_p are served: tests/unit/server/test_server_sampling.py.)
REFUSED: list[tuple[str, str, Any, str]] = [
    (COMPLETION, "suffix", "tail", "suffix is not supported"),
    (COMPLETION, "logprobs", 0, "logprobs are not supported"),
    (COMPLETION, "echo", True, "echo is not supported"),
    (COMPLETION, "best_of", 3, "only best_of=1 is supported"),
    (CHAT, "top_logprobs", 2, "top_logprobs are not supported"),
    (CHAT, "logprobs", True, "logprobs are not supported"),
]


@pytest.mark.parametrize(("path", "field", "value", "message"), REFUSED)
async def test_refused_parameters_are_400_with_their_message(
    api: httpx.AsyncClient, path: str, field: str, value: Any, message: str
) -> None:
    body = {"prompt": "hi", "max_tokens": 1} if path == COMPLETION else {**CHAT_BODY, "max_tokens": 1}
    response = await api.post(path, json={**body, field: value})
    assert_error(response, 400, field)
    assert response.json()["error"]["message"] == message
    # Their neutral values (what clients send by default) are accepted.
    neutral = {"n": 1, "best_of": 1, "echo": False}
    if field in neutral:
        accepted = await api.post(path, json={**body, field: neutral[field]})
        assert accepted.status_code == 200, accepted.text


async def test_admission_defaults_to_twice_the_sequence_cap(tiny_model_dir) -> None:
    # No --max-pending: twice max_num_seqs in force (here 4, so 8); a batch of 9 could never fit.
    core = CoreProcess.launch(EngineArgs(model=str(tiny_model_dir), **ENGINE_OPTIONS, max_num_seqs=4))
    try:
        async with app_client(core) as client:
            body = {"model": MODEL_NAME, "max_tokens": 1}
            refused = await client.post(COMPLETION, json={**body, "prompt": [[1]] * 9})
            assert refused.status_code == 400, refused.text
            assert "(8, --max-pending)" in refused.json()["error"]["message"]
            accepted = await client.post(COMPLETION, json={**body, "prompt": [[1]] * 8})
            assert accepted.status_code == 200, accepted.text
            assert len(accepted.json()["choices"]) == 8
    finally:
        core.shutdown()


async def test_after_the_core_dies_health_and_requests_answer_503(tiny_model_dir) -> None:
    core = CoreProcess.launch(EngineArgs(model=str(tiny_model_dir), **ENGINE_OPTIONS))
    try:
        async with app_client(core) as client:
            assert (await client.get("/health")).status_code == 200
            core.process.kill()
            core.process.join(10)
            for _ in range(100):  # the app hears of it from the event loop (the process's sentinel)
                health = await client.get("/health")
                if health.status_code != 200:
                    break
                await asyncio.sleep(0.02)
            assert health.status_code == 503 and "engine core" in health.json()["error"]["message"]
            refused = await client.post(
                COMPLETION, json={"model": MODEL_NAME, "prompt": [1], "max_tokens": 1}
            )
            assert refused.status_code == 503 and "engine core" in refused.json()["error"]["message"]
    finally:
        core.shutdown()

"""The sampling fields beyond OpenAI's basics, through the API: presence_penalty and frequency_penalty
(OpenAI's), repetition_penalty, min_p and top_k (vLLM's extras) reach the engine, bad values are 400s
naming the field, and logprobs stay refused (tests/unit/server/test_server_errors.py; several
choices a prompt, `n`: tests/unit/server/test_server_choices.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from server_testing import MODEL_NAME, LiveServer

from server.protocol import ChatCompletionRequest, CompletionRequest

COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
BODIES = {
    COMPLETION: {"prompt": [1000, 1001, 1002], "max_tokens": 4, "ignore_eos": True},
    CHAT: {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "ignore_eos": True},
}
BAD_VALUES = [
    ("presence_penalty", 2.5),
    ("presence_penalty", -2.01),
    ("frequency_penalty", 3),
    ("frequency_penalty", -100.0),
    ("repetition_penalty", 0),
    ("repetition_penalty", -1.5),
    ("min_p", 1.5),
    ("min_p", -0.1),
]
GOOD = {
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "repetition_penalty": 1.3,
    "min_p": 0.05,
    "top_k": 20,
    "temperature": 0.8,
    "seed": 4,
}


@pytest.mark.parametrize("path", [COMPLETION, CHAT])
@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
async def test_bad_values_are_400_naming_the_field(
    api: httpx.AsyncClient, path: str, field: str, value: Any
) -> None:
    response = await api.post(path, json={**BODIES[path], field: value})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "BadRequestError" and field in error["message"]


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"])
@pytest.mark.parametrize("value", [b"NaN", b"Infinity"])
async def test_non_finite_values_are_400(api: httpx.AsyncClient, field: str, value: bytes) -> None:
    content = b'{"prompt": "hi", "max_tokens": 2, "' + field.encode() + b'": ' + value + b"}"
    response = await api.post(COMPLETION, content=content, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field


@pytest.mark.parametrize("path", [COMPLETION, CHAT])
@pytest.mark.parametrize("stream", [False, True])
async def test_penalties_and_min_p_are_served_reproducibly(
    api: httpx.AsyncClient, path: str, stream: bool
) -> None:
    body = {**BODIES[path], **GOOD, "stream": stream, "stream_options": {"include_usage": True}}
    texts = []
    for _ in range(2):
        response = await api.post(path, json=body)
        assert response.status_code == 200, response.text
        texts.append(response.text if stream else response.json()["choices"][0])
    if not stream:  # seeded: the same choice twice (streams differ only in their ids and times)
        assert texts[0] == texts[1]


def test_the_fields_reach_the_engine_and_default_to_off() -> None:
    for request in (
        CompletionRequest(prompt="hi", **GOOD),
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **GOOD),
    ):
        params = request.sampling_params(3)
        assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (
            0.5,
            -0.5,
            1.3,
        )
        assert (params.min_p, params.top_k, params.seed) == (0.05, 20, 4)
    plain = CompletionRequest(prompt="hi", presence_penalty=None, min_p=None).sampling_params(3)
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty, plain.min_p) == (
        0.0,
        0.0,
        1.0,
        0.0,
    )
    assert not plain.uses_penalties


async def test_the_openai_client_sends_them(live_server: Callable[..., LiveServer]) -> None:
    with live_server() as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        completion = await client.completions.create(
            model=MODEL_NAME,
            prompt="hello",
            max_tokens=3,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            extra_body={"repetition_penalty": 1.1, "min_p": 0.1, "top_k": 8, "ignore_eos": True},
        )
        assert completion.usage is not None and completion.usage.completion_tokens == 3
        with pytest.raises(openai.BadRequestError) as bad:
            await client.chat.completions.create(
                model=MODEL_NAME,
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=2,
                extra_body={"repetition_penalty": 0.0},
            )
        assert bad.value.body["param"] == "repetition_penalty"  # type: ignore[index]

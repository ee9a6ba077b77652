"""Several choices a prompt (`n`), through the API: each choice is a request of its own in the engine,
numbered prompt x n + j as OpenAI's and vLLM's servers number them; with a seed, choice j draws as a
request alone with seed + j would (vLLM's rule), so the choices differ and each is reproducible; usage
counts each prompt once and every choice's tokens; a disconnect frees every choice's blocks; two API
processes give the same choices.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest
from server_testing import MODEL_NAME, LiveServer, ServerProcess, metric, parse_metrics, wait_for_metric

from engine.sampling_params import choice_seed
from server.protocol import MAX_CHOICES

COMPLETION = "/v1/completions"
CHAT = "/v1/chat/completions"
PROMPTS = [[1000, 1001, 1002], [2000, 2001, 2002, 2003, 2004]]
SAMPLED = {"max_tokens": 8, "ignore_eos": True, "temperature": 1.0}


async def texts(api: httpx.AsyncClient, body: dict[str, Any]) -> tuple[list[str], dict[str, int]]:
    """The choices' texts in index order, and the usage."""
    response = await api.post(COMPLETION, json=body)
    assert response.status_code == 200, response.text
    answer = response.json()
    assert [c["index"] for c in answer["choices"]] == list(range(len(answer["choices"])))
    return [c["text"] for c in answer["choices"]], answer["usage"]


async def test_seeded_choices_are_the_requests_alone_with_seed_plus_j(api: httpx.AsyncClient) -> None:
    seed = 2**64 - 2  # the last choices' seeds wrap past the top of the range: still valid
    choices, usage = await texts(api, {**SAMPLED, "prompt": PROMPTS, "n": 3, "seed": seed})
    assert len(choices) == 6
    alone = []
    for prompt in PROMPTS:
        for j in range(3):
            [text], _ = await texts(api, {**SAMPLED, "prompt": prompt, "seed": choice_seed(seed, j)})
            alone.append(text)
    assert choices == alone  # index = prompt x n + j
    assert len(set(choices[:3])) == 3, choices  # one prompt's choices differ
    assert usage == {
        "prompt_tokens": sum(len(p) for p in PROMPTS),  # each prompt once, not n times
        "completion_tokens": 6 * 8,
        "total_tokens": sum(len(p) for p in PROMPTS) + 48,
    }
    again, _ = await texts(api, {**SAMPLED, "prompt": PROMPTS, "n": 3, "seed": seed})
    assert again == choices


async def test_greedy_choices_agree_and_unseeded_ones_are_whole(api: httpx.AsyncClient) -> None:
    greedy, _ = await texts(api, {**SAMPLED, "prompt": PROMPTS[0], "n": 4, "temperature": 0.0})
    assert len(greedy) == 4 and len(set(greedy)) == 1
    unseeded, usage = await texts(api, {**SAMPLED, "prompt": PROMPTS[0], "n": 5})
    assert len(unseeded) == 5 and usage["completion_tokens"] == 40


async def test_streamed_chat_choices_carry_their_index_and_add_up_to_the_answer(
    api: httpx.AsyncClient,
) -> None:
    body = {
        "messages": [{"role": "user", "content": "hi"}],
        **SAMPLED,
        "n": 3,
        "seed": 11,
        "stream_options": {"include_usage": True},
    }
    whole = await api.post(CHAT, json=body)
    assert whole.status_code == 200, whole.text
    expected = [c["message"]["content"] for c in whole.json()["choices"]]
    streamed = await api.post(CHAT, json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    contents = [""] * 3
    roles, finishes = set(), set()
    for event in events[:-1]:
        for choice in event["choices"]:
            delta = choice["delta"]
            if delta.get("role"):
                roles.add(choice["index"])
            contents[choice["index"]] += delta.get("content") or ""
            if choice["finish_reason"]:
                finishes.add(choice["index"])
    assert roles == finishes == {0, 1, 2}
    assert contents == expected
    assert events[-1]["usage"]["completion_tokens"] == 24


@pytest.mark.parametrize(
    ("path", "body"),
    [(COMPLETION, {"prompt": "hi"}), (CHAT, {"messages": [{"role": "user", "content": "hi"}]})],
)
@pytest.mark.parametrize("n", [0, -1, MAX_CHOICES + 1])
async def test_n_out_of_range_is_400_naming_it(
    api: httpx.AsyncClient, path: str, body: dict[str, Any], n: int
) -> None:
    response = await api.post(path, json={**body, "max_tokens": 1, "n": n})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "n" and f"[1, {MAX_CHOICES}]" in error["message"]


async def test_choices_past_the_admission_limit_never_fit(api: httpx.AsyncClient) -> None:
    # The test server admits 64 requests at most: 2 prompts x 40 choices could never be taken.
    response = await api.post(COMPLETION, json={"prompt": PROMPTS, "max_tokens": 1, "n": 40})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "n"
    ok = await api.post(COMPLETION, json={"prompt": PROMPTS, "max_tokens": 1, "n": 32})
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 64


async def test_a_client_gone_mid_stream_frees_every_choice(live_server: Callable[..., LiveServer]) -> None:
    with live_server() as url:
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            body = {"prompt": PROMPTS[1], "max_tokens": 60, "ignore_eos": True, "n": 6, "stream": True}
            async with client.stream("POST", COMPLETION, json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        break  # the first token is out
                assert await metric(client, "engine_requests_running") == 6
            # Leaving the block closed the connection mid-stream: all six end, every block comes back.
            assert await wait_for_metric(client, "engine_kv_blocks_used", lambda v: v == 0, timeout=3) == 0
            assert await metric(client, "engine_requests_running") == 0
            assert await metric(client, 'engine_request_success_total{finished_reason="abort"}') == 6
            assert await metric(client, "server_requests_pending") == 0


async def test_the_openai_client_gets_its_n_choices(live_server: Callable[..., LiveServer]) -> None:
    with live_server() as url:
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        chat = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            n=3,
            seed=5,
            extra_body={"ignore_eos": True},
        )
        assert [c.index for c in chat.choices] == [0, 1, 2]
        assert chat.usage is not None and chat.usage.completion_tokens == 12
        completion = await client.completions.create(
            model=MODEL_NAME, prompt=["a", "b"], max_tokens=2, n=2, extra_body={"ignore_eos": True}
        )
        assert [c.index for c in completion.choices] == [0, 1, 2, 3]


def test_two_api_processes_give_the_same_choices(start_server: Callable[..., ServerProcess]) -> None:
    # Whichever API process takes the connection, the core draws each choice with its own seed.
    server = start_server("--api-server-count", "2")
    body = {**SAMPLED, "prompt": PROMPTS[0], "n": 3, "seed": 21}
    answers = []
    for _ in range(6):  # new connections: each lands on either process
        with httpx.Client(base_url=server.url, timeout=30) as client:
            response = client.post(COMPLETION, json=body)
            assert response.status_code == 200, response.text
            answers.append([c["text"] for c in response.json()["choices"]])
        with httpx.Client(base_url=server.url, timeout=30) as client:
            metrics = parse_metrics(client.get("/metrics").text)
        assert metrics["server_requests_pending"] == 0 and metrics["engine_kv_blocks_used"] == 0
    assert all(answer == answers[0] for answer in answers) and len(set(answers[0])) == 3
    assert metrics['engine_request_success_total{finished_reason="length"}'] == 18

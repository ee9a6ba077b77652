"""Fuzzing a real `python -m server` process (black box): schemathesis over the server's own OpenAPI
document, then hypothesis strategies for OpenAI bodies (wrong types, huge, negative and non-finite
numbers, seeds past 2^64, unicode and lone surrogates, nested junk, oversized prompts, unknown fields,
chat without max_tokens).

Every answer must be a 2xx, or a 4xx with the OpenAI error body; requests are sent one at a time, so
nothing is ever pending when one arrives and a 503 is a failure too; a stream must end with `data:
[DONE]`, every event before it JSON. Every request goes out through httpx and its body is read whole:
schemathesis generates the cases, never sends them (its transport stops reading an event stream after
some events, so a whole stream looked cut short). No request may take longer than REQUEST_DEADLINE_S,
a deadline that catches a hang. Afterwards the server holds no KV block, is healthy, serves a normal
completion, and its log holds no traceback. Bounded: a fixed number of examples, derandomized (the
same cases every run; set FUZZ_RANDOM=1 to explore new ones).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from server_testing import ServerProcess, parse_metrics, sse_payloads

# A deadline that catches a hang, not a speed: the longest answer is 64 tokens of the tiny model, well
# under a second on a quiet 2-core machine and under 3 s beside another test worker.
REQUEST_DEADLINE_S = 30.0
MAX_MODEL_LEN = 64
MAX_PENDING = 8
SCHEMA_EXAMPLES = 40  # per operation and generation mode (positive, negative)
BODY_EXAMPLES = 150  # per endpoint
FUZZ_SETTINGS = settings(
    deadline=None,
    database=None,
    derandomize=not os.environ.get("FUZZ_RANDOM"),
    suppress_health_check=list(HealthCheck),
    print_blob=True,
    # No shrinking: a failing body is small enough to read as generated, and shrinking a hang replays
    # candidates up to the deadline each (one CI run spent over five minutes on it).
    phases=(Phase.explicit, Phase.reuse, Phase.generate),
)
CASES: Counter[str] = Counter()  # statuses seen, by endpoint; reported at the end
# The fewest cases each fuzz test that ran in this process must have sent (hypothesis may stop early):
# the closing test holds this process's count to the tests that ran here, whatever the distribution.
EXPECTED_AT_LEAST: dict[str, float] = {}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("fuzz") / "server.log"
    process = ServerProcess(
        tiny_model_dir,
        log,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--num-kv-blocks",
        "16",
        "--max-pending",
        str(MAX_PENDING),
        "--max-request-bytes",
        str(1 << 20),
        "--disable-uvicorn-access-log",
    )
    yield process
    process.close()


@contextmanager
def hang_explained(server: ServerProcess) -> Iterator[None]:
    """A request that outlives REQUEST_DEADLINE_S fails with the end of the server's log: a hang,
    with what the server was doing."""
    try:
        yield
    except httpx.TimeoutException as error:
        raise AssertionError(
            f"no answer within {REQUEST_DEADLINE_S} s; the server's log ends:\n{server.log_text()[-4000:]}"
        ) from error


def check_answer(label: str, status: int, content_type: str, body: bytes, elapsed_s: float) -> None:
    """The invariant of every answer (see the module docstring)."""
    CASES[f"{label} {status}"] += 1
    assert elapsed_s < REQUEST_DEADLINE_S
    assert status < 500, f"{status}: {body[:500]!r}"
    if 200 <= status < 300:
        if content_type.startswith("text/event-stream"):
            events = sse_payloads(body.decode())
            assert events and events[-1] == "[DONE]", body[-300:]
            for event in events[:-1]:
                error = event.get("error") if isinstance(event, dict) else None
                assert error is None or 400 <= error["code"] < 500, event
        return
    assert 400 <= status < 500, status
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    assert isinstance(error["message"], str) and error["message"]


def test_schemathesis_over_the_openapi_document(server: ServerProcess) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
    EXPECTED_AT_LEAST["schemathesis"] = 2 * 2 * SCHEMA_EXAMPLES * 0.5  # two operations with bodies, two modes
    with httpx.Client(timeout=REQUEST_DEADLINE_S) as client:
        for operation in operations:
            label = f"{operation.method.upper()} {operation.path}"
            if not len(operation.body) and not list(operation.iter_parameters()):
                # no body and no parameters (GET /v1/models, POST /reset_prefix_cache): nothing negative to generate
                fuzz_operation(client, operation.as_strategy(), label, 5, server)
                continue
            for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
                strategy = operation.as_strategy(generation_mode=mode)
                fuzz_operation(client, strategy, label, SCHEMA_EXAMPLES, server)


def send_case(client: httpx.Client, case: schemathesis.Case, url: str) -> httpx.Response:
    """The generated case's request (method, URL, query, headers, body as schemathesis serializes
    them) sent through httpx, which reads the body whole: schemathesis's own transport stops reading an
    event stream after some events, and a healthy stream would end without `[DONE]`."""
    request = case.as_transport_kwargs(base_url=url)
    headers = dict(request["headers"])
    if request.get("cookies"):  # httpx takes cookies per client, not per request
        headers["Cookie"] = "; ".join(f"{name}={value}" for name, value in request["cookies"].items())
    content: bytes | str | None = request.get("data")
    if "json" in request:
        content = json.dumps(request["json"]).encode()  # NaN and Infinity as Python writes them
    assert content is None or isinstance(content, bytes | str), f"a body httpx cannot send: {content!r}"
    return client.request(
        request["method"],
        request["url"],
        params=request.get("params") or None,
        headers=headers,
        content=content,
    )


def fuzz_operation(
    client: httpx.Client, cases: st.SearchStrategy[Any], label: str, examples: int, server: ServerProcess
) -> None:
    @settings(FUZZ_SETTINGS, max_examples=examples)
    @given(case=cases)
    def run(case: schemathesis.Case) -> None:
        start = time.monotonic()
        with hang_explained(server):
            response = send_case(client, case, server.url)
        elapsed = time.monotonic() - start
        content_type = response.headers.get("content-type", "")
        check_answer(label, response.status_code, content_type, response.content, elapsed)

    run()


# A stream of more events than schemathesis 4.32's transport reads of one (20): read by send_case, it
# must still end with [DONE] and carry every token.
LONG_STREAM_TOKENS = 40
LONG_STREAMS: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": [1000, 2000, 3000]},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
}


@pytest.mark.parametrize("path", list(LONG_STREAMS))
def test_a_long_stream_of_a_schema_case_is_read_whole(server: ServerProcess, path: str) -> None:
    """A case of the server's own schema that streams past where schemathesis's transport stops
    reading: sent by send_case, it is checked as every generated case is, and its usage chunk (just
    before [DONE], so only a whole stream has it) counts every token asked for."""
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    body: dict[str, Any] = {
        **LONG_STREAMS[path],
        "max_tokens": LONG_STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    case = schema[path]["POST"].Case(body=body, media_type="application/json")
    with httpx.Client(timeout=REQUEST_DEADLINE_S) as client:
        start = time.monotonic()
        with hang_explained(server):
            response = send_case(client, case, server.url)
        elapsed = time.monotonic() - start
    content_type = response.headers.get("content-type", "")
    assert content_type.startswith("text/event-stream"), (response.status_code, response.text[:500])
    check_answer(f"POST {path} (long stream)", response.status_code, content_type, response.content, elapsed)
    events = sse_payloads(response.text)
    assert events[-2]["usage"]["completion_tokens"] == LONG_STREAM_TOKENS, events[-2]


# -- hypothesis bodies --------------------------------------------------------------------------
JUNK = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)
EDGE_INTS = st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63) - 1, 10**30])
INTS = st.integers(min_value=-5, max_value=80) | EDGE_INTS | st.integers()
FLOATS = st.floats() | st.sampled_from([0.0, 1e-300, 1e300, -0.0, math.inf, math.nan]) | st.floats(0, 2)
ODD_TEXT = st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "é" * 40, "🙂" * 30, "<|im_end|>", "x " * 200])
TEXT = st.text(max_size=40) | ODD_TEXT
TOKEN_IDS = st.lists(st.integers(0, 31_999), min_size=1, max_size=20)
PROMPTS = (
    TEXT
    | TOKEN_IDS
    | st.lists(st.integers(), max_size=5)  # ids outside the vocabulary
    | st.lists(TEXT, min_size=1, max_size=4)
    | st.lists(TOKEN_IDS, min_size=1, max_size=MAX_PENDING + 2)  # batches, some past --max-pending
    | st.sampled_from([[1] * (MAX_MODEL_LEN + 1), "word " * 5_000, [[]]])
)


def maybe(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """A field's value: often a plausible one, sometimes junk of any type."""
    return st.one_of(strategy, strategy, JUNK)


SAMPLING_FIELDS = {
    "model": maybe(st.sampled_from(["tiny", "other", ""])),
    "max_tokens": maybe(INTS),
    "temperature": maybe(FLOATS),
    "top_p": maybe(FLOATS),
    "top_k": maybe(INTS),
    "seed": maybe(INTS),
    "stop": maybe(TEXT | st.lists(TEXT, max_size=3)),
    "stop_token_ids": maybe(st.lists(INTS, max_size=3)),
    "ignore_eos": maybe(st.booleans()),
    "stream": maybe(st.booleans()),
    "stream_options": maybe(st.fixed_dictionaries({}, optional={"include_usage": maybe(st.booleans())})),
    "n": maybe(INTS),
    "presence_penalty": maybe(FLOATS),
    "frequency_penalty": maybe(FLOATS),
    "user": maybe(TEXT),
}
UNKNOWN_FIELDS = st.dictionaries(
    st.text(min_size=1, max_size=12).filter(lambda k: k not in SAMPLING_FIELDS), JUNK, max_size=3
)
COMPLETION_BODIES = st.builds(
    lambda known, unknown: {**unknown, **known},
    st.fixed_dictionaries(
        {"prompt": maybe(PROMPTS)},
        optional={
            **SAMPLING_FIELDS,
            "logprobs": maybe(INTS),
            "echo": maybe(st.booleans()),
            "best_of": maybe(INTS),
            "suffix": maybe(TEXT),
        },
    ),
    UNKNOWN_FIELDS,
)
MESSAGE = st.fixed_dictionaries(
    {"role": maybe(st.sampled_from(["system", "user", "assistant", "tool", ""])), "content": maybe(TEXT)}
) | st.fixed_dictionaries(
    {
        "role": st.just("user"),
        "content": st.lists(
            st.fixed_dictionaries({"type": maybe(st.just("text")), "text": maybe(TEXT)}), max_size=3
        ),
    }
)
CHAT_BODIES = st.builds(
    lambda known, unknown: {**unknown, **known},
    st.fixed_dictionaries(
        {"messages": maybe(st.lists(MESSAGE, max_size=4))},  # often without max_tokens
        optional={
            **SAMPLING_FIELDS,
            "max_completion_tokens": maybe(INTS),
            "logprobs": maybe(st.booleans()),
            "top_logprobs": maybe(INTS),
            "add_generation_prompt": maybe(st.booleans()),
        },
    ),
    UNKNOWN_FIELDS,
)
# Requests that should mostly succeed, so that generation, streaming and stops are fuzzed too.
PLAUSIBLE_TEXT = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)
PLAUSIBLE_FIELDS = {
    "max_tokens": st.integers(1, 24),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": PLAUSIBLE_TEXT | st.lists(PLAUSIBLE_TEXT, max_size=2),
    "stop_token_ids": st.lists(st.integers(0, 31_999), max_size=2),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
}
PLAUSIBLE = {
    "/v1/completions": st.fixed_dictionaries(
        {"prompt": PLAUSIBLE_TEXT | TOKEN_IDS | st.lists(TOKEN_IDS, min_size=1, max_size=3)},
        optional=PLAUSIBLE_FIELDS,
    ),
    "/v1/chat/completions": st.fixed_dictionaries(
        {
            "messages": st.lists(
                st.fixed_dictionaries(
                    {"role": st.sampled_from(["system", "user", "assistant"]), "content": PLAUSIBLE_TEXT}
                ),
                min_size=1,
                max_size=3,
            )
        },
        optional=PLAUSIBLE_FIELDS,  # max_tokens often left out: the rest of the 64-token context
    ),
}
BODIES = {
    path: st.one_of(PLAUSIBLE[path], junk_bodies, JUNK)  # JUNK: now and then not an object at all
    for path, junk_bodies in (("/v1/completions", COMPLETION_BODIES), ("/v1/chat/completions", CHAT_BODIES))
}


@pytest.mark.parametrize("path", list(BODIES))
def test_hypothesis_bodies(server: ServerProcess, path: str) -> None:
    EXPECTED_AT_LEAST[f"bodies {path}"] = BODY_EXAMPLES * 0.5
    with httpx.Client(base_url=server.url, timeout=REQUEST_DEADLINE_S) as client:

        @settings(FUZZ_SETTINGS, max_examples=BODY_EXAMPLES)
        @given(body=BODIES[path])
        def run(body: Any) -> None:
            content = json.dumps(body).encode()  # NaN and Infinity as Python writes them
            start = time.monotonic()
            with hang_explained(server):
                response = client.post(path, content=content, headers={"content-type": "application/json"})
            check_answer(
                f"POST {path} (bodies)",
                response.status_code,
                response.headers.get("content-type", ""),
                response.content,
                time.monotonic() - start,
            )

        run()


def test_the_server_is_whole_afterwards(server: ServerProcess) -> None:
    if not EXPECTED_AT_LEAST:
        # Under pytest-xdist's default `load` distribution this module's tests can land on several
        # workers, each with a server of its own; scripts/test.sh keeps a module on one (loadfile).
        pytest.skip("no fuzz test ran in this process: nothing to check afterwards (use --dist loadfile)")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        assert client.get("/health").json() == {"status": "ok"}
        answer = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "ignore_eos": True})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
        deadline = time.monotonic() + 5
        while True:
            metrics = parse_metrics(client.get("/metrics").text)
            idle = metrics["engine_kv_blocks_used"] == 0 and metrics["server_requests_pending"] == 0
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert idle, metrics
    log = server.log_text()
    assert "Traceback" not in log and "engine step failed" not in log, log[-3000:]
    total = sum(CASES.values())
    print(f"\nfuzz cases: {total}; by endpoint and status: {dict(sorted(CASES.items()))}")
    assert total >= sum(EXPECTED_AT_LEAST.values()), EXPECTED_AT_LEAST

"""Chat completions in bench: the chat body, its SSE parser (the role chunk first, content deltas,
usage last; TTFT at the first chunk with content), against the fake server whose timings are known
and against this project's server with the tiny model."""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.client import Endpoint, is_arrival, request_body
from bench.fake_server import FakeServerConfig, FakeServerThread
from bench.launch import ServerProcess, ServerSpec
from bench.runner import LoadConfig, run_closed_loop
from bench.workload import Request, WorkloadSpec, make_request

TTFT, ITL, TOKENS = 0.1, 0.01, 12
SERVER_START_DEADLINE_S = 120.0  # a deadline against a server that never gets ready, not a speed


def chat_workload(model, **kwargs) -> WorkloadSpec:
    return WorkloadSpec(api="chat", tokenizer=str(model), **kwargs)


def test_the_chat_body_carries_the_prompt_as_one_user_message():
    request = Request(0, "hello there", 2, 16, temperature=1.0, top_p=0.95, api="chat")
    body = request_body("m", request)
    assert body["messages"] == [{"role": "user", "content": "hello there"}]
    assert "prompt" not in body
    assert (body["max_tokens"], body["temperature"], body["top_p"]) == (16, 1.0, 0.95)
    assert body["ignore_eos"] is True and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    with pytest.raises(ValueError, match="text"):
        request_body("m", Request(0, [1, 2], 2, 16, api="chat"))


def test_only_chunks_with_content_are_arrivals_in_a_chat_stream():
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    content = {"choices": [{"index": 0, "delta": {"content": " x"}}]}
    finish = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    assert [is_arrival(event, chat=True) for event in (role, content, finish, usage)] == [
        False,
        True,
        False,
        False,
    ]
    text = {"choices": [{"index": 0, "text": ""}]}
    assert is_arrival(text, chat=False) and not is_arrival(usage, chat=False)


def test_a_chat_workload_sends_text_sized_to_the_templated_prompt(tiny_model_dir):
    from bench.prompts import chat_overhead, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    overhead = chat_overhead(str(tiny_model_dir))
    assert overhead > 0  # the tiny model has a ChatML template
    request = make_request(chat_workload(tiny_model_dir, kind="fixed", input_len=100), 0)
    assert request.api == "chat" and isinstance(request.prompt, str) and request.prompt_len == 100
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": request.prompt}], tokenize=False, add_generation_prompt=True
    )
    assert len(tokenizer.encode(rendered, add_special_tokens=False)) == 100


def test_a_chat_prompt_shorter_than_its_template_is_counted_at_the_length_sent(tiny_model_dir):
    """The seed-mix asks for 16-token prompts, fewer than ChatML's markers alone: the request goes out
    as the template around one token, and its prompt_len says so (the server's usage then agrees)."""
    from bench.prompts import chat_overhead, load_tokenizer

    tokenizer = load_tokenizer(str(tiny_model_dir))
    overhead = chat_overhead(str(tiny_model_dir))
    request = make_request(chat_workload(tiny_model_dir, kind="fixed", input_len=overhead - 2), 0)
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": request.prompt}], tokenize=False, add_generation_prompt=True
    )
    assert request.prompt_len == len(tokenizer.encode(rendered, add_special_tokens=False)) == overhead + 1


def test_chat_against_the_fake_server_times_the_first_content(tiny_model_dir):
    """The fake server sends the role chunk at once and the first content TTFT later: TTFT must be
    the content's, and the role and finish chunks no arrivals."""
    workload = chat_workload(tiny_model_dir, kind="fixed", input_len=32, output_len=TOKENS)
    with FakeServerThread(FakeServerConfig(ttft_s=TTFT, itl_s=ITL)) as fake:
        endpoint = Endpoint(fake.base_url, "fake-model", target="fake")
        result = run_closed_loop(endpoint, workload, 2, LoadConfig(n_requests=4, progress=False))
    summary = result.summary
    assert summary["failures"] == 0, result.rows[0].error
    assert summary["ttft_p50_s"] >= TTFT
    assert all(row.chunks == TOKENS and row.output_tokens == TOKENS for row in result.rows)
    assert all(len(row.itls_s) == TOKENS - 1 for row in result.rows)
    assert summary["itl_p50_s"] == pytest.approx(ITL, abs=0.005)


def test_a_chat_stream_with_no_text_counts_its_tokens_but_has_no_ttft(tiny_model_dir):
    """A random-weight model can generate only tokens the server decodes to nothing (special tokens it
    skips): that stream's chunks carry empty content, so nothing arrives to time. The level still
    counts its tokens and sums up (it raised on the NaN TTFT before), and says how many there were."""
    workload = chat_workload(tiny_model_dir, kind="fixed", input_len=32, output_len=TOKENS)
    with FakeServerThread(FakeServerConfig(ttft_s=TTFT, itl_s=ITL, silent_every=2)) as fake:
        endpoint = Endpoint(fake.base_url, "fake-model", target="fake")
        result = run_closed_loop(endpoint, workload, 2, LoadConfig(n_requests=6, progress=False))
    summary = result.summary
    silent = [row for row in result.rows if row.first_token_s is None]
    assert len(silent) == 3 and all(row.ok and row.output_tokens == TOKENS for row in silent)
    assert (summary["failures"], summary["completed"], summary["no_text"]) == (0, 6, 3)
    assert summary["ttft_p50_s"] >= TTFT and summary["tpot_p50_s"] == pytest.approx(ITL, abs=0.005)
    assert summary["output_tok_s"] == pytest.approx(6 * TOKENS / summary["duration_s"])


def test_chat_against_the_server_with_the_tiny_model(tiny_model_dir, tmp_path):
    spec = ServerSpec.for_target("engine", str(tiny_model_dir), "float32")
    with ServerProcess(spec, tmp_path / "server.log") as process:
        process.start(timeout_s=SERVER_START_DEADLINE_S)
        endpoint = Endpoint(spec.base_url, model=str(tiny_model_dir), target="engine")
        workload = chat_workload(tiny_model_dir, kind="fixed", input_len=120, output_len=8)
        result = run_closed_loop(endpoint, workload, 2, LoadConfig(n_requests=4, progress=False))
        out = tmp_path / "run"
        argv = ["run", "--base-url", spec.base_url, "--api", "chat", "--workload", "fixed"]
        argv += ["--input-len", "40", "--output-len", "4", "--concurrency", "1", "--n-requests", "2"]
        assert main([*argv, "--quiet", "--out", str(out)]) == 0
    summary = result.summary
    assert summary["failures"] == 0, [row.error for row in result.rows]
    assert all(row.output_tokens == 8 and row.first_token_s is not None for row in result.rows)
    assert (summary["prompt_tokens_checked"], summary["prompt_tokens_mismatched"]) == (4, 0)
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["workload"]["api"] == "chat"
    (level,) = run["levels"]
    assert (level["completed"], level["prompt_tokens_mismatched"]) == (2, 0)

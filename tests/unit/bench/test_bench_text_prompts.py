"""Text prompts of a target token length (bench.prompts, WorkloadSpec(prompt_format="text")): made from
the model's tokenizer, fixed by the seed, and checked against the server's `usage.prompt_tokens`,
against the real server with the tiny model too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bench.__main__ import main
from bench.client import Endpoint
from bench.launch import ServerProcess, ServerSpec
from bench.metrics import RequestRow, check_prompt_tokens, prompt_tokens_tolerance
from bench.prompts import load_tokenizer, text_prompt
from bench.runner import LoadConfig, run_closed_loop
from bench.workload import SEED_MIX_PROMPT_LENS, WorkloadSpec, make_request

SERVER_START_DEADLINE_S = 120.0  # a deadline against a server that never gets ready, not a speed


def text_mix(model: Path, seed: int = 0, **kwargs) -> WorkloadSpec:
    return WorkloadSpec(seed=seed, prompt_format="text", tokenizer=str(model), **kwargs)


@pytest.mark.parametrize("target", [1, 16, 255, 1024])
def test_a_text_prompt_encodes_to_its_target_length(tiny_model_dir, target):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rng = np.random.default_rng(target)
    ids = rng.integers(1000, 30000, size=target).tolist()
    made = text_prompt(tokenizer, ids, target, rng, (1000, 30000))
    assert made.tokens == target
    assert len(tokenizer.encode(made.text, add_special_tokens=False)) == target


def test_too_few_ids_are_topped_up_and_too_many_cut(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    rng = np.random.default_rng(0)
    assert text_prompt(tokenizer, [2000, 2001], 40, rng, (1000, 30000)).tokens == 40
    assert text_prompt(tokenizer, list(range(2000, 2100)), 7, rng, (1000, 30000)).tokens == 7


class GrowingTokenizer:
    """A tokenizer whose text never settles: encoding the decoded ids gives them back with one token
    more (as a byte piece that merges differently once decoded might), so no round of text_prompt
    lands on the target."""

    all_special_ids: list[int] = []

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids) + " 7"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [int(word) for word in text.split()]


@pytest.mark.parametrize("start", [3, 40, 400])
def test_a_prompt_that_never_settles_is_cut_to_the_target_never_longer(start):
    tokenizer = GrowingTokenizer()
    rng = np.random.default_rng(0)
    made = text_prompt(tokenizer, list(range(1000, 1000 + start)), 40, rng, (1000, 30000))
    assert len(tokenizer.encode(made.text)) == made.tokens
    assert made.tokens == 40  # one id fewer than the target, and its text encodes to the target


def test_seed_mix_text_is_fixed_by_the_seed_and_keeps_the_token_id_shape(tiny_model_dir):
    tokenizer = load_tokenizer(str(tiny_model_dir))
    ids = [make_request(WorkloadSpec(seed=3), i) for i in range(12)]
    text = [make_request(text_mix(tiny_model_dir, seed=3), i) for i in range(12)]
    again = [make_request(text_mix(tiny_model_dir, seed=3), i) for i in range(12)]
    other = [make_request(text_mix(tiny_model_dir, seed=4), i) for i in range(12)]
    assert [r.prompt for r in text] == [r.prompt for r in again]
    assert [r.prompt for r in text] != [r.prompt for r in other]
    assert all(isinstance(r.prompt, str) for r in text)
    # the same lengths and budgets as the token-id workload of the seed, measured by the tokenizer
    assert [(r.prompt_len, r.max_tokens) for r in text] == [(r.prompt_len, r.max_tokens) for r in ids]
    assert {r.prompt_len for r in text} <= set(SEED_MIX_PROMPT_LENS)
    counted = [len(tokenizer.encode(r.prompt, add_special_tokens=False)) for r in text]
    assert counted == [r.prompt_len for r in text]


def test_text_prompts_need_the_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        WorkloadSpec(prompt_format="text")
    with pytest.raises(ValueError, match="prompt_format"):
        WorkloadSpec(prompt_format="words")  # type: ignore[arg-type]


def row(prompt_len: int, counted: int | None, status: str = "ok", warmup: bool = False) -> RequestRow:
    made = RequestRow("t", "closed", None, 1, 0, 0, warmup, prompt_len, 8, 0.0, 0.0, status=status)
    made.usage_prompt_tokens = counted
    return made


def test_the_prompt_token_check_counts_mismatches_and_those_outside_tolerance():
    rows = [
        row(100, 100),
        row(100, 101),  # off by one: a mismatch, within tolerance (2 tokens or 1 %)
        row(1000, 990),  # off by 10 = 1 %: within
        row(1000, 1011),  # off by 11: outside
        row(16, 13),  # off by 3: outside
        row(16, None),  # no usage: not checked
        row(16, 99, status="short"),  # failed: not checked
        row(16, 99, warmup=True),  # warm-up: not checked
    ]
    check = check_prompt_tokens(rows)
    assert check["prompt_tokens_checked"] == 5
    assert check["prompt_tokens_mismatched"] == 4
    assert check["prompt_tokens_mismatch_pct"] == pytest.approx(80.0)
    assert check["prompt_tokens_outside_tolerance"] == 2
    assert check["prompt_tokens_off_max"] == 11
    assert prompt_tokens_tolerance(16) == 2 and prompt_tokens_tolerance(4096) == 41


@pytest.fixture(scope="module")
def tiny_server(tiny_model_dir, tmp_path_factory):
    """This project's server with the tiny model on CPU, as the perf tier starts it."""
    spec = ServerSpec.for_target("engine", str(tiny_model_dir), "float32")
    with ServerProcess(spec, tmp_path_factory.mktemp("logs") / "server.log") as process:
        process.start(timeout_s=SERVER_START_DEADLINE_S)
        yield Endpoint(spec.base_url, model=str(tiny_model_dir), target="engine")


def test_the_server_counts_the_text_prompts_at_their_length(tiny_server, tiny_model_dir):
    workload = text_mix(tiny_model_dir, kind="fixed", input_len=200, output_len=4)
    result = run_closed_loop(tiny_server, workload, 2, LoadConfig(n_requests=4, progress=False))
    summary = result.summary
    assert summary["failures"] == 0
    assert summary["prompt_tokens_checked"] == 4
    assert summary["prompt_tokens_mismatched"] == 0, [r.usage_prompt_tokens for r in result.rows]
    # No prompt-length warning (a busy machine may add a client-lag one, which is not this test's).
    assert not [w for w in result.warnings if "prompt" in w], result.warnings


def test_bench_run_sends_text_and_records_the_check(tiny_server, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    argv = ["run", "--base-url", tiny_server.base_url, "--workload", "fixed", "--input-len", "64"]
    argv += ["--output-len", "4", "--concurrency", "2", "--n-requests", "4", "--quiet", "--out", str(out)]
    argv += ["--prompt-format", "text"]  # the tokenizer: the served model's name, a folder
    assert main(argv) == 0
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["workload"]["prompt_format"] == "text"
    assert run["config"]["workload"]["tokenizer"] == str(Path(tiny_model_dir).resolve())
    (level,) = run["levels"]
    assert (level["prompt_tokens_checked"], level["prompt_tokens_mismatched"]) == (4, 0)

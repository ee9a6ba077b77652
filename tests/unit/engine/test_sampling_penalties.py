"""Repetition, presence and frequency penalties against a plain reference: the arithmetic element by
element, and whole generations through the engine against transformers' logits with the penalties
applied by hand (vLLM's semantics), with and without recompute preemption (the counts rebuilt from
the host's token lists) and with the async steps' placeholder tokens in flight.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from engine.penalties import PROMPT_FLAG, apply_penalties


def _penalized(
    logits: list[float], prompt: list[int], output: list[int], params: SamplingParams
) -> list[float]:
    """vLLM's penalties on one row, token by token in Python floats."""
    result = []
    for token, logit in enumerate(logits):
        count = output.count(token)
        if token in prompt or count:
            rep = params.repetition_penalty
            logit = logit / rep if logit > 0 else logit * rep
        logit -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
        result.append(logit)
    return result


def test_apply_penalties_matches_the_plain_reference():
    rng = random.Random(0)
    vocab, rows = 30, 6
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    cases = []
    for row in range(rows):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        output = [rng.randrange(vocab) for _ in range(rng.randrange(0, 20))]
        params = SamplingParams(
            presence_penalty=rng.choice([0.0, 0.5, -1.5, 2.0]),
            frequency_penalty=rng.choice([0.0, 0.3, -2.0]),
            repetition_penalty=rng.choice([1.0, 1.2, 0.7, 3.0]),
        )
        counts[row, prompt] = PROMPT_FLAG
        for token in output:
            counts[row, token] += 1
        cases.append((prompt, output, params))
    penalized = apply_penalties(
        logits,
        counts,
        torch.tensor([p.presence_penalty for _, _, p in cases]),
        torch.tensor([p.frequency_penalty for _, _, p in cases]),
        torch.tensor([p.repetition_penalty for _, _, p in cases]),
    )
    for row, (prompt, output, params) in enumerate(cases):
        expected = _penalized(logits[row].tolist(), prompt, output, params)
        torch.testing.assert_close(penalized[row], torch.tensor(expected), rtol=1e-6, atol=1e-6)


PENALTIES = [
    {"repetition_penalty": 1.8},
    {"presence_penalty": 1.5, "frequency_penalty": 0.7},
    {"repetition_penalty": 0.6, "frequency_penalty": -0.5},
    {"presence_penalty": 2.0, "frequency_penalty": 2.0, "repetition_penalty": 1.3},
]
MAX_TOKENS = 14


def _prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(1000, 30000) for _ in range(n)] for n in (3, 17, 40, 9)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir) -> list[list[int]]:
    """Greedy with each prompt's penalties, from transformers' logits, one forward pass a token."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    outputs = []
    for prompt, penalties in zip(_prompts(), PENALTIES, strict=True):
        params = SamplingParams(**penalties)
        output: list[int] = []
        for _ in range(MAX_TOKENS):
            with torch.no_grad():
                logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            row = _penalized(logits.tolist(), prompt, output, params)
            output.append(max(range(len(row)), key=row.__getitem__))
        outputs.append(output)
    return outputs


def _greedy_params() -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, **p) for p in PENALTIES]


def test_penalized_greedy_matches_the_reference(tiny_model_dir, expected):
    llm = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    outputs = llm.generate(_prompts(), _greedy_params())
    assert [o.token_ids for o in outputs] == expected
    # The penalties changed something: plain greedy differs for at least one prompt.
    plain = llm.generate(_prompts(), SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    assert [o.token_ids for o in plain] != expected
    assert len(llm.engine.runner.sampler.penalties) == 0  # every row given back


def test_penalties_survive_preemption_and_chunked_prefill(tiny_model_dir, expected):
    """Few KV blocks: sequences are preempted mid-generation and recomputed; their count rows are
    dropped then and rebuilt from the host's tokens when they sample again."""
    engine = LLMEngine(
        EngineArgs(
            model=str(tiny_model_dir),
            device="cpu",
            max_model_len=64,
            block_size=4,
            num_kv_blocks=18,
            max_num_seqs=4,
            max_num_batched_tokens=16,
        )
    )
    for i, (prompt, params) in enumerate(zip(_prompts(), _greedy_params(), strict=True)):
        engine.add_request(str(i), prompt, params)
    final: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.token_ids
    assert engine.scheduler.num_preemptions > 0
    assert [final[str(i)] for i in range(len(expected))] == expected


def test_sampled_penalized_requests_repeat_alone_in_a_batch_and_under_preemption(tiny_model_dir):
    prompts = _prompts()
    params = [
        SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, ignore_eos=True, min_p=0.02, **p)
        for i, p in enumerate(PENALTIES)
    ]
    roomy = LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=256)
    alone = [roomy.generate([prompt], p)[0].token_ids for prompt, p in zip(prompts, params, strict=True)]
    assert [o.token_ids for o in roomy.generate(prompts, params)] == alone
    tight = LLM(
        str(tiny_model_dir),
        device="cpu",
        max_model_len=64,
        block_size=4,
        num_kv_blocks=18,
        max_num_seqs=4,
        max_num_batched_tokens=16,
    )
    assert [o.token_ids for o in tight.generate(prompts, params)] == alone
    assert tight.engine.scheduler.num_preemptions > 0

"""Greedy generation equals transformers' `generate`, token for token, on the same synthetic weights.

Run twice per layout: with a token budget small enough to split prompts into chunks, and with so few
KV blocks that sequences must be preempted and recomputed.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams

PROMPT_LENGTHS = (1, 5, 16, 17, 40, 100)  # 1 token up to several 16-token blocks
MAX_TOKENS = (8, 20, 3, 12, 16, 10)


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 30000) for _ in range(n)] for n in PROMPT_LENGTHS]


def _reference(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outputs = []
    for prompt, max_tokens in zip(prompts, MAX_TOKENS, strict=True):
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False
        )
        outputs.append(ids[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def case(request, tiny_model_dir, tiny_llama_model_dir):
    model_dir = tiny_model_dir if request.param == "tiny" else tiny_llama_model_dir
    prompts = _prompts()
    return model_dir, prompts, _reference(model_dir, prompts)


def _generate(model_dir, prompts, **options):
    llm = LLM(str(model_dir), device="cpu", **options)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in MAX_TOKENS]
    return llm, llm.generate(prompts, params)


def test_chunked_prefill_matches_transformers(case):
    model_dir, prompts, expected = case
    llm, outputs = _generate(model_dir, prompts, max_num_batched_tokens=24, max_num_seqs=4)
    assert max(PROMPT_LENGTHS) > 24  # the longest prompts really are split into chunks
    assert [o.token_ids for o in outputs] == expected
    assert [o.text for o in outputs] == [llm.tokenizer.decode(e) for e in expected]
    assert llm.engine.allocator.num_used_blocks == 0
    llm.engine.allocator.check_integrity()


def test_preemption_matches_transformers(case):
    model_dir, prompts, expected = case
    llm, outputs = _generate(model_dir, prompts, num_kv_blocks=26, block_size=8, max_model_len=128)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.allocator.num_used_blocks == 0
    llm.engine.allocator.check_integrity()

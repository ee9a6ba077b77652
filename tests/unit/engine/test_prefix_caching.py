"""Prefix caching end to end on CPU, on the tiny synthetic checkpoints.

Greedy tokens with the cache on equal the cache off and transformers' `generate`, for prompts that
share 0, 1, a block and a half, several and all of their full blocks with an earlier prompt, arriving
one after another (each finds what the earlier ones left) and together under a small token budget (the
later ones are admitted after the first has registered blocks), with async steps (the engine's only
mode). The KV the shared blocks hold is never written again, and a wholly cached prompt's last block,
computed again into a block of its own, comes out bit for bit what the cached block holds.
"""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, EngineArgs, LLMEngine, SamplingParams
from engine.block_allocator import hash_block

BLOCK_SIZE = 16
MAX_TOKENS = 6


def _prompts() -> dict[str, list[int]]:
    """The first prompt, then prompts sharing a given part of it (16-token blocks)."""
    rng = random.Random(7)
    first = [rng.randrange(1000, 30000) for _ in range(100)]

    def own(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    return {
        "first": first,
        "nothing shared": own(20),
        "one block": first[:16] + own(5),
        "a block and a half": first[:24] + own(6),  # only the full block can be shared
        "five blocks": first[:80] + own(10),
        "four whole blocks": first[:64],  # wholly cached: 3 taken, the last block computed again
        "four blocks and a token": first[:65],
        "the first again": first,
    }


# Tokens found cached, one after another: 16 + 16 + 80 + 48 + 64 + (100 - 1) // 16 * 16.
EXPECTED_HITS = 16 + 16 + 80 + 48 + 64 + 96


@pytest.fixture(scope="module", params=["tiny", "tiny-llama"])
def case(request, tiny_model_dir, tiny_llama_model_dir):
    model_dir = tiny_model_dir if request.param == "tiny" else tiny_llama_model_dir
    prompts = _prompts()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    expected = {}
    for name, prompt in prompts.items():
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
        )
        expected[name] = ids[0, len(prompt) :].tolist()
    return model_dir, prompts, expected


def _llm(model_dir, **options) -> LLM:
    return LLM(str(model_dir), **{"device": "cpu", "block_size": BLOCK_SIZE, "max_model_len": 256, **options})


PARAMS = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def test_one_after_another_matches_cache_off_and_transformers(case):
    model_dir, prompts, expected = case
    cached = _llm(model_dir)
    uncached = _llm(model_dir, enable_prefix_caching=False)
    for name, prompt in prompts.items():
        assert cached.generate(prompt, PARAMS)[0].token_ids == expected[name], name
        assert uncached.generate(prompt, PARAMS)[0].token_ids == expected[name], name
    stats = cached.engine.stats()
    assert stats.prefix_cache_hits == EXPECTED_HITS
    assert stats.prefix_cache_queries == sum(len(p) for p in prompts.values())
    assert stats.kv_blocks_used == 0 and stats.kv_blocks_cached > 0
    cached.engine.allocator.check_integrity()
    assert uncached.engine.stats().kv_blocks_cached == 0
    assert uncached.engine.stats().prefix_cache_hits == 0


def test_together_matches_cache_off_and_transformers(case):
    """All at once with a 32-token budget: the first prompt's chunks run first, and the others are
    admitted in later steps, on its blocks, while it and each other still run (shared blocks in use)."""
    model_dir, prompts, expected = case
    names = list(prompts)
    for caching in (True, False):
        llm = _llm(model_dir, enable_prefix_caching=caching, max_num_batched_tokens=32, max_num_seqs=4)
        outputs = llm.generate([prompts[n] for n in names], PARAMS)
        assert {n: o.token_ids for n, o in zip(names, outputs, strict=True)} == expected
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0
        assert (stats.prefix_cache_hits > 0) == caching
        llm.engine.allocator.check_integrity()


def test_preemption_with_shared_blocks_matches_transformers(case):
    """So few blocks that sequences holding shared blocks are preempted, and recomputed on the cache."""
    model_dir, prompts, expected = case
    names = list(prompts)
    llm = _llm(model_dir, num_kv_blocks=10, max_model_len=128, max_num_batched_tokens=32, max_num_seqs=4)
    outputs = llm.generate([prompts[n] for n in names], PARAMS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert {n: o.token_ids for n, o in zip(names, outputs, strict=True)} == expected
    assert llm.engine.stats().kv_blocks_used == 0
    llm.engine.allocator.check_integrity()


def _kv(engine: LLMEngine, blocks: list[int]) -> torch.Tensor:
    """[layers, 2 (K, V), len(blocks), block_size, kv_heads, head_dim] of the given blocks, copied."""
    layers = engine.runner.model.layers
    return torch.stack([layer.self_attn.kv_cache[:, blocks] for layer in layers]).clone()


def test_shared_blocks_are_never_written_and_the_recomputed_block_is_bit_identical(tiny_model_dir):
    engine = LLMEngine(
        EngineArgs(
            model=str(tiny_model_dir),
            device="cpu",
            num_kv_blocks=32,
            block_size=BLOCK_SIZE,
            max_model_len=256,
        )
    )
    prompt = _prompts()["first"][:48]  # three full blocks
    hashes: list[bytes] = []
    for start in range(0, 48, BLOCK_SIZE):
        hashes.append(hash_block(hashes[-1] if hashes else None, prompt[start : start + BLOCK_SIZE]))

    def run(request_id: str) -> tuple[list[int], list[int]]:
        engine.add_request(request_id, prompt, PARAMS)
        engine.step()  # its prompt step: launched, and the table stays until it finishes
        (seq,) = engine.scheduler.running
        table = list(engine.allocator.block_table(seq.seq_id))
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens += out.new_token_ids
        return table, tokens

    first_table, first_tokens = run("a")
    cached = engine.allocator.match_prefix(hashes, 3)
    assert cached == first_table[:3] and engine.stats().kv_blocks_used == 0
    before = _kv(engine, cached)
    second_table, second_tokens = run("b")
    # (48 - 1) // 16 = 2 blocks shared; the last computed again into a block of b's own.
    assert second_table[:2] == cached[:2] and second_table[2] not in cached
    assert engine.stats().prefix_cache_hits == 32
    assert torch.equal(_kv(engine, cached), before), "a shared block was written"
    assert torch.equal(_kv(engine, second_table[2:3]), before[:, :, 2:3]), "recomputed KV differs"
    assert second_tokens == first_tokens
    engine.allocator.check_integrity()


@pytest.mark.gpu
def test_on_cuda_the_triton_path_gives_the_same_tokens_with_the_cache(tiny_model_dir):
    """float32 on CUDA (Triton kernels, decode graphs): with the cache on, the paged prefill kernel
    starts prompts after shared blocks; the tokens must be the cache-off ones, together and one after
    another."""
    prompts = _prompts()
    names = list(prompts)
    results = {}
    for caching in (True, False):
        llm = _llm(
            tiny_model_dir,
            device="cuda",
            dtype="float32",
            max_num_batched_tokens=32,
            max_num_seqs=4,
            enable_prefix_caching=caching,
        )
        assert llm.engine.runner.backend.name == "triton" and llm.engine.runner.graphs is not None
        together = [o.token_ids for o in llm.generate([prompts[n] for n in names], PARAMS)]
        one_by_one = [llm.generate(prompts[n], PARAMS)[0].token_ids for n in names]
        stats = llm.engine.stats()
        assert stats.kv_blocks_used == 0
        llm.engine.allocator.check_integrity()
        results[caching] = (together, one_by_one, stats.prefix_cache_hits)
        del llm
        gc.collect()  # the engine holds reference cycles: free its KV cache before the next one sizes its own
        torch.cuda.empty_cache()
    assert results[True][:2] == results[False][:2]
    assert results[True][2] > 0 and results[False][2] == 0

"""Steps with prompt chunks through the mixed-step graphs' attention, against the plain forward pass.

A mixed-step graph fixes its kernels' grids at capture: the decode kernel covers as many rows as the
step may have decodes and the prefill kernel graph_prefills chunks, and both read the step from
buffers the runner fills for it (decode lengths 0 past the decodes, empty chunks past the chunks,
padding tokens with KV slot -1). Here the graphs run uncaptured (`capture=False`: the same forward
pass and metadata a replay runs; on CPU through Triton's interpreter), so steps padded to the
ladder's sizes must pick the same greedy tokens in float32 as the engine without them.
tests/unit/engine/test_gpu.py replays captured graphs.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.cuda_graphs import CudaGraphRunner, token_count_ladder

STEP_TOKENS = 64


def test_the_ladder_pads_a_step_by_at_most_a_quarter_past_64_tokens():
    sizes = token_count_ladder(4096)
    assert sizes[:5] == [16, 32, 48, 64, 80]
    assert sizes[-1] == 4096 and sizes == sorted(set(sizes))
    for n in range(1, 4097):
        padded = next(s for s in sizes if s >= n)
        assert padded - n < max(16, n // 4 + 1), (n, padded)
    assert token_count_ladder(100) == [16, 32, 48, 64, 80, 96, 100]
    assert token_count_ladder(8) == [8]


def test_a_finer_ladder_pads_by_at_most_an_eighth_past_128_tokens():
    sizes = token_count_ladder(4096, steps_per_doubling=8)
    assert sizes[-1] == 4096 and sizes == sorted(set(sizes))
    assert [s for s in sizes if 1024 <= s <= 2048] == list(range(1024, 2049, 128))
    for n in range(1, 4097):
        padded = next(s for s in sizes if s >= n)
        assert padded - n < max(16, n // 8 + 1), (n, padded)
    assert set(token_count_ladder(4096)) < set(sizes)
    with pytest.raises(ValueError, match="steps_per_doubling"):
        token_count_ladder(4096, steps_per_doubling=0)


def _generate(model_dir, device, graphs: bool, prompts, max_num_seqs: int = 8):
    """Greedy tokens, and each step's (prompt chunks, padded size of the mixed graph it replayed or 0)."""
    llm = LLM(
        str(model_dir),
        device=str(device),
        dtype="float32",
        attention_backend="triton",
        max_model_len=256,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=STEP_TOKENS,  # long prompts are chunked beside the running decodes
        block_size=8,
        num_kv_blocks=256,  # sized, not measured: on CUDA, earlier tests' engines may still hold memory
        enforce_eager=True,  # no captured graphs: the test installs uncaptured ones
    )
    runner = llm.engine.runner
    assert runner.mixed_graphs is None
    steps: list[tuple[int, int]] = []
    if graphs:
        runner.mixed_graphs = CudaGraphRunner(
            runner.model,
            runner.buffers,
            runner._mixed_graph_metadata,
            token_count_ladder(STEP_TOKENS),
            capture=False,
        )
        prepare = runner.prepare

        def noted(*args):
            batch = prepare(*args)
            steps.append((batch.metadata.num_seqs - batch.metadata.num_decodes, batch.mixed_size))
            return batch

        runner.prepare = noted  # type: ignore[method-assign]
    # 5 tokens: the steps with prompt chunks are the point; the decodes after them repeat one kernel
    # shape, which the interpreter runs one program at a time
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats().kv_blocks_used == 0
    return tokens, steps, runner


def test_padded_mixed_steps_through_the_graphs_attention_pick_the_plain_forward_passs_tokens(
    tiny_model_dir, device
):
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in (1, 5, 17, 40, 90)]
    reference, _, _ = _generate(tiny_model_dir, device, False, prompts)
    tokens, steps, _ = _generate(tiny_model_dir, device, True, prompts)
    assert tokens == reference
    replayed = [size for _, size in steps if size]
    assert len(replayed) == len(steps), f"a step ran eagerly: {steps}"
    assert any(chunks >= 2 for chunks, _ in steps), f"no step carried several chunks: {steps}"
    assert len(set(replayed)) >= 2, f"every step had the same padded size: {steps}"


def test_a_step_of_more_chunks_than_a_graph_holds_runs_eagerly(tiny_model_dir, device):
    """Nine short prompts admitted in one step: more chunks than the graphs' eight. That step runs
    eagerly, the decodes after it replay the graphs, and the tokens are the plain forward pass's."""
    rng = random.Random(5)
    prompts = [[rng.randrange(100, 30000) for _ in range(3)] for _ in range(9)]
    reference, _, _ = _generate(tiny_model_dir, device, False, prompts, max_num_seqs=16)
    tokens, steps, runner = _generate(tiny_model_dir, device, True, prompts, max_num_seqs=16)
    assert tokens == reference
    assert runner.buffers.capacity.graph_prefills == 8
    assert steps[0] == (9, 0)
    assert all(size for _, size in steps[1:]), steps


def test_a_negative_mixed_graph_limit_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        LLM(str(tiny_model_dir), device="cpu", dtype="float32", mixed_graph_max_tokens=-1)
    with pytest.raises(ValueError, match="mixed_graph_ladder_steps"):
        LLM(str(tiny_model_dir), device="cpu", dtype="float32", mixed_graph_ladder_steps=0)

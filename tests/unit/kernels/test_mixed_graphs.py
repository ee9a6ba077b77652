"""The mixed step's piecewise forward pass (engine.mixed_graphs) against the plain one.

The segments run as they would be captured, without the capture (`capture=False`; on CPU there are
no CUDA graphs): the same pieces, edge buffers and padding rows. Steps with prompt chunks beside
decodes, padded to the ladder's sizes, must pick the same greedy tokens in float32 as the engine
without them, on the torch reference and on the Triton kernels (on CPU through the interpreter: the
in-place norms and the attention writing into the edge buffer). tests/unit/engine/test_gpu.py
replays the captured graphs.
"""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.mixed_graphs import MixedStepGraphs, token_count_ladder

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


class CountingGraphs(MixedStepGraphs):
    """The pieces without capture, counting each step's real and padded token counts."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, capture=False, **kwargs)
        self.steps: list[tuple[int, int]] = []

    def run(self, size, meta):
        self.steps.append((meta.query_start_loc_cpu[-1], size))
        return super().run(size, meta)


def _generate(model_dir, device, backend: str, pieces: bool, prompts):
    llm = LLM(
        str(model_dir),
        device=str(device),
        dtype="float32",
        attention_backend=backend,
        max_model_len=256,
        max_num_seqs=8,
        max_num_batched_tokens=STEP_TOKENS,  # long prompts are chunked beside the running decodes
        block_size=8,
        enforce_eager=True,  # no graphs unless the test installs the pieces
    )
    runner = llm.engine.runner
    assert runner.mixed_graphs is None
    graphs = None
    if pieces:
        graphs = runner.mixed_graphs = CountingGraphs(runner.model, runner.buffers, STEP_TOKENS)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.engine.stats().kv_blocks_used == 0
    return tokens, graphs


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_padded_mixed_steps_through_the_pieces_pick_the_plain_forward_passs_tokens(
    tiny_model_dir, device, backend
):
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in (1, 5, 17, 40, 90, 130)]
    reference, _ = _generate(tiny_model_dir, device, backend, False, prompts)
    tokens, graphs = _generate(tiny_model_dir, device, backend, True, prompts)
    assert tokens == reference
    assert graphs is not None
    mixed = [(n, size) for n, size in graphs.steps if n > 8]  # more tokens than sequences: a chunk rode along
    assert mixed, f"no step carried a prompt chunk: {graphs.steps}"
    assert any(size > n for n, size in graphs.steps), "no step was padded"
    assert all(size == next(s for s in graphs.sizes if s >= n) for n, size in graphs.steps)


def test_a_negative_mixed_graph_limit_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        LLM(str(tiny_model_dir), device="cpu", dtype="float32", mixed_graph_max_tokens=-1)

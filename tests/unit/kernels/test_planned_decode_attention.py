"""The planned decode kernel (a mixed step's decodes) against the same plain-torch reference as the
one-split-count kernel (test_decode_attention).

CPU (interpreter): long and short contexts side by side split by their share of the step, the plan's
items, one plan shared by several layers (its counters back at zero), any lengths / program counts /
split caps (hypothesis). CUDA (marked gpu): bf16/fp16 at the real shapes, a closed loop's contexts, a
CUDA graph replayed over new lengths. Tolerances as test_decode_attention's.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_decode_attention import GPU_SHAPES, _gpu_lens, assert_close, make_inputs, reference_decode

from engine.kernels.decode_attention import MAX_SPLITS
from engine.kernels.planned_decode_attention import (
    FILL_PER_SM,
    _planned_decode_attention,
    fill_programs,
    plan_decode,
    planned_decode_attention,
    planned_num_splits,
)


def run(query, kv_cache, block_tables, seq_lens, scale, num_splits, **kwargs) -> torch.Tensor:
    """The launcher at the interpreter's tile (16 tokens), into an output of NaNs: every row is written."""
    return _planned_decode_attention(
        query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, num_splits,
        torch.full_like(query, float("nan")), block_n=16, num_warps=4, num_stages=2, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("fill,num_splits", [(1, 4), (2, 3), (5, 16), (64, 16), (8, 1)])
def test_uneven_contexts_split_by_their_share_of_the_step(fill, num_splits, device):
    """Long and short contexts side by side, the step's tokens shared among few or many programs: each
    sequence is cut into as many splits as its share of the step asks for (up to num_splits; with many
    programs the long ones into several, the short ones one), and the merge combines only a sequence's
    own splits."""
    dtype = torch.float32
    lens = [1000, 16, 0, 600, 257, 5, 513]
    query, kv_cache, block_tables, seq_lens = make_inputs(lens, 2, 3, 16, 16, dtype, device)
    scale = 16**-0.5
    out = run(query, kv_cache, block_tables, seq_lens, scale, num_splits, fill=fill)
    assert_close(out, reference_decode(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale), dtype)
    assert torch.all(out[2] == 0), "a padding row (seq_len 0) must give zeros"


@pytest.mark.parametrize("group,num_kv_heads", [(1, 2), (6, 2), (2, 1)])
def test_gqa_groups_and_half_precision(group, num_kv_heads, device):
    """GQA groups 1 / 6 / 2 in float16: each KV head's program serves its group's query heads."""
    dtype = torch.float16
    lens = [300, 7, 129, 64]
    query, kv_cache, block_tables, seq_lens = make_inputs(lens, num_kv_heads, group, 32, 16, dtype, device)
    kv_cache = kv_cache.to(dtype)
    out = run(query, kv_cache, block_tables, seq_lens, 32**-0.5, 4, fill=2)
    assert_close(
        out, reference_decode(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, 32**-0.5), dtype
    )


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    lens=st.lists(st.sampled_from([0, 1, 15, 16, 17, 255, 256, 257, 600, 1000]), min_size=1, max_size=6),
    fill=st.integers(1, 12),
    num_splits=st.integers(1, 5),
)
def test_any_lengths_fill_and_split_cap_match_reference(lens, fill, num_splits):
    """Whatever the step's lengths (empty rows among them), the programs its tokens are shared among and
    the cap on one sequence's splits: the planned items cover every sequence's context exactly once."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # hypothesis takes no fixture
    query, kv_cache, block_tables, seq_lens = make_inputs(lens, 1, 2, 16, 16, torch.float32, device)
    out = run(query, kv_cache, block_tables, seq_lens, 0.25, num_splits, fill=fill)
    expected = reference_decode(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, 0.25)
    assert_close(out, expected, torch.float32)


def plan_of(lens: list[int], num_splits: int, fill: int, device: torch.device) -> tuple[list, list]:
    """Each row's split count, and the items (row, start, end) of the plan for these lengths."""
    query = torch.zeros(len(lens), 12, 128, dtype=torch.float32, device=device)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    plan = plan_decode(query, seq_lens, num_splits, 2, fill=fill, block_n=64)
    items = [tuple(item[:3]) for item in plan.items.tolist() if item[0] >= 0]
    assert plan.programs == fill + len(lens) and len(items) <= plan.programs
    return plan.split_counts[: len(lens)].tolist(), items


def test_the_plan_splits_only_the_contexts_longer_than_the_steps_share(device):
    """Uniform contexts that fill the programs stay whole (a split more would cost a merge and read no
    faster); a long context among short ones is cut into splits of the step's share, up to the cap;
    and the items cover each context exactly once, in order."""
    counts, _ = plan_of([1024] * 128, 4, 99, device)
    assert counts == [1] * 128
    counts, _ = plan_of([1024] * 64, 4, 99, device)  # half the tokens: each in two
    assert counts == [2] * 64
    lens = [4352, 0, 3000] + [100] * 125
    counts, items = plan_of(lens, 16, 99, device)
    # the share, 19,852 / 99 -> 256 tokens; 4,352 capped at 16 splits of 272 -> 320 tokens: 14, none empty
    assert counts[:3] == [14, 0, 12] and counts[3:] == [1] * 125
    assert plan_of(lens, 8, 99, device)[0][:3] == [8, 0, 8]
    for row, length in enumerate(lens):
        ends = [0] + [end for item_row, start, end in items if item_row == row]
        starts = [start for item_row, start, end in items if item_row == row]
        assert starts == ends[:-1] and ends[-1] == length and len(starts) == counts[row]


def test_one_plan_serves_every_layer_and_leaves_its_counters_at_zero(device):
    """A step plans once and every layer's launch reads the plan: the split that finishes a row last
    merges it and puts the row's counter back to zero, so the next launch (another layer's K/V, the
    same lengths) merges correctly too; a plan made for other KV heads is refused."""
    dtype, lens, num_splits = torch.float32, [1000, 16, 0, 600, 257], 4
    query, kv_cache, block_tables, seq_lens = make_inputs(lens, 2, 3, 16, 16, dtype, device)
    plan = plan_decode(query, seq_lens, num_splits, 2, fill=3, block_n=16)
    assert max(plan.split_counts[: len(lens)].tolist()) > 1, "the case must merge some row"
    for layer in range(3):
        layer_cache = kv_cache * (layer + 1) if layer else kv_cache  # each layer its own K/V
        out = run(query, layer_cache, block_tables, seq_lens, 0.25, num_splits, plan=plan)
        expected = reference_decode(query, layer_cache[0], layer_cache[1], block_tables, seq_lens, 0.25)
        assert_close(out, expected, dtype)
        assert plan.arrivals.tolist() == [0] * (len(lens) * 2)
    other_heads = plan_decode(query, seq_lens, num_splits, 3, fill=3, block_n=16)
    with pytest.raises(ValueError, match="KV heads"):
        run(query, kv_cache, block_tables, seq_lens, 0.25, num_splits, plan=other_heads)


def test_bad_arguments_are_refused(device):
    query, kv_cache, block_tables, seq_lens = make_inputs([5, 9, 3], 1, 2, 16, 4, torch.float32, device)
    with pytest.raises(ValueError, match="fill must be at least 1"):
        run(query, kv_cache, block_tables, seq_lens, 0.25, 2, fill=0)
    with pytest.raises(ValueError, match="num_splits"):
        run(query, kv_cache, block_tables, seq_lens, 0.25, 0)


def test_planned_num_splits_and_programs():
    # 256-token splits at least, MAX_SPLITS at most: the plan picks each sequence's own count below it.
    assert planned_num_splits(4096) == MAX_SPLITS
    assert planned_num_splits(32768) == MAX_SPLITS
    assert planned_num_splits(1024) == 4
    assert planned_num_splits(100) == 1
    assert planned_num_splits(0) == 1
    # FILL_PER_SM a SM over the KV heads, never none
    assert fill_programs(2, 132) == int(FILL_PER_SM * 132 / 2)
    assert fill_programs(8, 1) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,head_dim,group,num_kv_heads,batch,max_len", GPU_SHAPES)
def test_gpu_matches_reference(dtype, head_dim, group, num_kv_heads, batch, max_len):
    device = torch.device("cuda")
    lens = _gpu_lens(batch, max_len, seed=batch)
    query, kv_cache, block_tables, seq_lens = make_inputs(
        lens, num_kv_heads, group, head_dim, 16, dtype, device
    )
    scale = head_dim**-0.5
    out = planned_decode_attention(
        query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, planned_num_splits(max_len)
    )
    assert_close(out, reference_decode(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale), dtype)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_over_a_closed_loops_contexts():
    """Captured once over a graph's rows (128 decodes and padding), plan and all layers' launches, then
    replayed after the lengths and block tables change in place: 16-token and 4,352-token contexts side
    by side, as a seed-mix closed loop holds them; two launches share the plan, as layers do."""
    device = torch.device("cuda")
    dtype, head_dim, group, num_kv_heads, rows = torch.bfloat16, 128, 6, 2, 160
    query, kv_cache, block_tables, seq_lens = make_inputs(
        [4352] * rows, num_kv_heads, group, head_dim, 16, dtype, device
    )
    num_splits = planned_num_splits(4352)
    outs = [torch.empty_like(query) for _ in range(2)]
    caches = [kv_cache, kv_cache.flip(-1)]  # two layers' K/V

    def step() -> None:
        plan = plan_decode(query, seq_lens, num_splits, num_kv_heads)
        for out, cache in zip(outs, caches, strict=True):
            args = (query, cache[0], cache[1], block_tables, seq_lens, head_dim**-0.5, num_splits)
            planned_decode_attention(*args, out=out, plan=plan)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    generator = torch.Generator().manual_seed(7)
    lens = torch.randint(16, 4353, (rows,), generator=generator)
    lens[:3] = torch.tensor([4352, 16, 1])
    lens[128:] = 0  # the graph's padding rows
    seq_lens.copy_(lens.to(torch.int32))
    block_tables.copy_(block_tables.flip(0))
    for _ in range(2):  # a second replay finds the counters at zero
        graph.replay()
        torch.cuda.synchronize()
        for out, cache in zip(outs, caches, strict=True):
            expected = reference_decode(query, cache[0], cache[1], block_tables, seq_lens, head_dim**-0.5)
            assert_close(out, expected, dtype)
            assert torch.all(out[128:] == 0)

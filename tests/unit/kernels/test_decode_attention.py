"""Paged decode attention against a plain-torch reference (gather through the block table, float32 softmax).

CPU (interpreter): tiny shapes in float32/float16 over block boundaries, GQA groups 1/2/6, splits with
empty ones, a padding row, scrambled block tables, strided query and cache views. CUDA (marked gpu):
bf16/fp16 at the real shapes, CUDA-graph replay. Tolerances: float32 2e-5 (atol and rtol); fp16 and
bf16 2e-2 (the kernel rounds the softmax weights to the cache dtype before P @ V, as flash attention does).
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.decode_attention import (
    MAX_SPLITS,
    _paged_decode_attention,
    choose_num_splits,
    paged_decode_attention,
)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def reference_decode(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
) -> torch.Tensor:
    """[num_seqs, num_heads, head_dim] float32: per sequence, gather its context and attend in float32."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_seqs, num_heads, head_dim, dtype=torch.float32, device=query.device)
    for i, length in enumerate(seq_lens.tolist()[:num_seqs]):
        if length == 0:
            continue
        positions = torch.arange(length, device=query.device)
        blocks = block_tables[i, positions // block_size].long()
        keys = key_cache[blocks, positions % block_size].float()  # [length, num_kv_heads, head_dim]
        values = value_cache[blocks, positions % block_size].float()
        keys = keys.repeat_interleave(group, dim=1)  # [length, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[i].float(), keys) * scale
        out[i] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), values)
    return out


def make_inputs(
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query, kv_cache [2, num_blocks, block_size, kv_heads, dim], block_tables int32, seq_lens int32).

    Blocks are handed out in a random order (plus spare blocks full of noise), so a kernel that assumed
    contiguous blocks would fail. query is a strided view into a fused-qkv-like buffer.
    """
    generator = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-length // block_size) for length in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(seq_lens), max(max(blocks_per_seq), 1), dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = order[used : used + count]
        used += count
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    num_heads = num_kv_heads * group
    # [num_seqs, (num_heads + 2 * num_kv_heads) * head_dim], as a fused qkv projection writes it
    qkv = torch.randn(len(seq_lens), (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    qkv = qkv.to(device=device, dtype=dtype)
    query = qkv[:, : num_heads * head_dim].view(len(seq_lens), num_heads, head_dim)
    return (
        query,
        kv_cache.to(device=device, dtype=dtype),
        block_tables.to(device),
        torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


# (dtype, num_kv_heads, group, head_dim, block_size, num_splits, block_n). Contexts cover 1 token, a
# block boundary, one past it, a padding row (0) and long enough ones for several tiles and splits.
CPU_CASES = [
    (torch.float32, 2, 1, 32, 4, 1, 16),
    (torch.float32, 1, 2, 16, 16, 4, 16),
    (torch.float32, 2, 6, 32, 4, 3, 16),
    (torch.float16, 1, 6, 32, 16, 1, 16),
    (torch.float16, 2, 2, 16, 4, 5, 16),
    (torch.float32, 1, 6, 32, 16, 2, 64),  # the 64-token tile bf16/fp16 use on the GPU
    (torch.float16, 1, 7, 64, 8, 2, 32),
]


@pytest.mark.parametrize("dtype,num_kv_heads,group,head_dim,block_size,num_splits,block_n", CPU_CASES)
def test_small_cases_match_reference(
    dtype, num_kv_heads, group, head_dim, block_size, num_splits, block_n, device
):
    lens = [1, block_size, block_size + 1, 0, 3 * block_size + 7, 150]
    query, kv_cache, block_tables, seq_lens = make_inputs(
        lens, num_kv_heads, group, head_dim, block_size, dtype, device
    )
    scale = head_dim**-0.5
    out = _paged_decode_attention(
        query,
        kv_cache[0],
        kv_cache[1],
        block_tables,
        seq_lens,
        scale,
        num_splits,
        None,
        block_n=block_n,
        num_warps=4,
        num_stages=2,
    )
    assert out.dtype == dtype and out.shape == query.shape
    assert_close(out, reference_decode(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale), dtype)
    assert torch.all(out[3] == 0), "a padding row (seq_len 0) must give zeros"


def test_public_launcher_writes_out_in_place_and_ignores_extra_rows(device):
    """out= is written in place; block_tables/seq_lens may have more rows than query (graph padding) and
    may be int64."""
    dtype, head_dim, block_size = torch.float16, 32, 16
    query, kv_cache, block_tables, seq_lens = make_inputs(
        [17, 0, 40, 33],
        num_kv_heads=2,
        group=2,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    query = query[:3]  # the fourth row of block_tables / seq_lens belongs to no query
    block_tables, seq_lens = block_tables.long(), seq_lens.long()  # int64 is accepted too
    out = torch.full_like(query, float("nan"))
    result = paged_decode_attention(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, 0.3, 2, out=out)
    assert result.data_ptr() == out.data_ptr()
    expected = reference_decode(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, 0.3)
    assert_close(out, expected, dtype)
    assert torch.all(out[1] == 0)


def test_all_padding_rows_give_zeros_not_nan(device):
    query, kv_cache, block_tables, _ = make_inputs([16, 16], 1, 2, 16, 4, torch.float32, device)
    seq_lens = torch.zeros(2, dtype=torch.int32, device=device)
    for num_splits in (1, 3):
        out = paged_decode_attention(
            query, kv_cache[0], kv_cache[1], block_tables, seq_lens, 0.25, num_splits
        )
        assert torch.all(out == 0)


def test_choose_num_splits():
    # Batch 1 at 4k context: 2 KV heads alone would use 2 SMs; splits spread it over many.
    assert choose_num_splits(1, 2, 4096) == MAX_SPLITS
    assert choose_num_splits(1, 2, 4096, num_sms=132) * 2 >= 32
    # Each split covers at least 256 tokens of the longest context.
    assert choose_num_splits(1, 2, 1024) == 4
    assert choose_num_splits(1, 2, 100) == 1
    assert choose_num_splits(1, 2, 0) == 1
    # Large batches already fill the GPU.
    assert choose_num_splits(256, 2, 2048) == 1
    assert choose_num_splits(512, 8, 4096) == 1
    for num_seqs in (1, 2, 7, 64, 300):
        for max_context in (1, 255, 256, 1000, 4096, 32768):
            splits = choose_num_splits(num_seqs, 2, max_context)
            assert 1 <= splits <= MAX_SPLITS
            assert splits == 1 or max_context // splits >= 256
            assert splits == choose_num_splits(num_seqs, 2, max_context)  # pure


def _strided_last_dim(tensor: torch.Tensor) -> torch.Tensor:
    """Same shape and values, but the last dimension has stride 2."""
    wide = torch.zeros(*tensor.shape[:-1], 2 * tensor.shape[-1], dtype=tensor.dtype, device=tensor.device)
    wide[..., ::2] = tensor
    return wide[..., ::2]


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "query": a["query"][0]}, "query must be"),
        (lambda a: {**a, "query": a["query"].half()}, "dtype"),
        (
            lambda a: {**a, "key_cache": a["key_cache"][..., :8], "value_cache": a["value_cache"][..., :8]},
            "head_dim",
        ),
        (lambda a: {**a, "value_cache": a["value_cache"][:-1]}, "value_cache shape"),
        (lambda a: {**a, "key_cache": _strided_last_dim(a["key_cache"])}, "contiguous last dimension"),
        (
            lambda a: {**a, "key_cache": a["key_cache"][:, :3], "value_cache": a["value_cache"][:, :3]},
            "power of two",
        ),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, "block_tables dtype"),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "block_tables must be"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].float()}, "seq_lens dtype"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens must be"),
        (lambda a: {**a, "num_splits": 0}, "num_splits"),
        (lambda a: {**a, "out": a["query"].half()}, "out must match"),
        (lambda a: {**a, "query": a["query"][:, :3]}, "multiple of num_kv_heads"),
    ],
)
def test_launcher_rejects_bad_inputs(change, message, device):
    query, kv_cache, block_tables, seq_lens = make_inputs([5, 9], 2, 2, 16, 4, torch.float32, device)
    arguments = {
        "query": query,
        "key_cache": kv_cache[0],
        "value_cache": kv_cache[1],
        "block_tables": block_tables,
        "seq_lens": seq_lens,
        "scale": 0.25,
        "num_splits": 2,
        "out": None,
    }
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**change(arguments))


def test_rejects_non_power_of_two_head_dim(device):
    query, kv_cache, block_tables, seq_lens = make_inputs([5], 1, 1, 24, 4, torch.float32, device)
    with pytest.raises(ValueError, match="head_dim must be one of"):
        paged_decode_attention(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, 0.2, 1)


# ---- CUDA: the shapes that matter, in bf16 and fp16 -------------------------------------------------


def _gpu_lens(batch: int, max_len: int, seed: int) -> list[int]:
    """Contexts 1..max_len: max_len first, then block-boundary values (16, 17, 4096, 4097...), then random."""
    generator = torch.Generator().manual_seed(seed)
    special = [1, 15, 16, 17, 255, 256, 257, 1024, 1025, 4095, 4096, 4097]
    lens = ([max_len] + [value for value in special if value < max_len])[:batch]
    lens += torch.randint(1, max_len + 1, (batch - len(lens),), generator=generator).tolist()
    return lens


# (dtype, head_dim, group, num_kv_heads, batch, max_len)
GPU_SHAPES = [
    (torch.bfloat16, 128, 6, 2, 1, 4352),
    (torch.bfloat16, 128, 6, 2, 13, 4352),
    (torch.bfloat16, 128, 6, 2, 64, 1100),
    (torch.bfloat16, 128, 6, 2, 256, 2100),
    (torch.bfloat16, 64, 8, 4, 32, 4352),
    (torch.bfloat16, 128, 7, 2, 16, 3000),
    (torch.bfloat16, 128, 2, 8, 4, 1000),
    (torch.float16, 64, 4, 8, 48, 2000),
    (torch.float16, 128, 8, 8, 8, 4352),
    (torch.float16, 64, 6, 2, 256, 600),
    (torch.float16, 128, 1, 4, 3, 300),
    (torch.float32, 128, 6, 2, 5, 1500),
]


@pytest.mark.gpu
@pytest.mark.parametrize("splits_rule", ["chosen", "one", "eight"])
@pytest.mark.parametrize("dtype,head_dim,group,num_kv_heads,batch,max_len", GPU_SHAPES)
def test_gpu_matches_reference(dtype, head_dim, group, num_kv_heads, batch, max_len, splits_rule):
    device = torch.device("cuda")
    lens = _gpu_lens(batch, max_len, seed=batch)
    query, kv_cache, block_tables, seq_lens = make_inputs(
        lens, num_kv_heads, group, head_dim, 16, dtype, device
    )
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    num_splits = {"chosen": choose_num_splits(batch, num_kv_heads, max_len, num_sms), "one": 1, "eight": 8}
    scale = head_dim**-0.5
    out = paged_decode_attention(
        query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, num_splits[splits_rule]
    )
    assert_close(out, reference_decode(query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale), dtype)


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_follows_new_seq_lens():
    """Captured once, replayed after seq_lens/block_tables change in place: the grid does not depend on them."""
    device = torch.device("cuda")
    dtype, head_dim, group, num_kv_heads, batch = torch.bfloat16, 128, 6, 2, 8
    query, kv_cache, block_tables, seq_lens = make_inputs(
        [2000] * batch, num_kv_heads, group, head_dim, 16, dtype, device
    )
    num_splits = choose_num_splits(batch, num_kv_heads, 2000)
    out = torch.empty_like(query)
    args = (query, kv_cache[0], kv_cache[1], block_tables, seq_lens, head_dim**-0.5, num_splits)
    paged_decode_attention(*args, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_decode_attention(*args, out=out)
    seq_lens.copy_(torch.tensor([1, 0, 17, 2000, 999, 256, 257, 1500], dtype=torch.int32))
    block_tables.copy_(block_tables.flip(0))
    graph.replay()
    torch.cuda.synchronize()
    expected = reference_decode(*args[:6])
    assert_close(out, expected, dtype)

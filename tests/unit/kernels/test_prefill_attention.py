"""Paged prefill attention against a plain-torch reference (gather each sequence's context through the block
table, float32 softmax with the causal mask offset by the tokens cached before the chunk).

CPU (interpreter): tiny shapes in float32/float16, block sizes 4 and 16, GQA groups 1/2/6/7, one launch
mixing a whole prompt, a chunk starting mid-block after cached tokens, a 1-token chunk and a chunk over
block boundaries; scrambled block tables, a strided query view, out=. CUDA (marked gpu): bf16/fp16 at
the real shapes, chunks of 1 to 8,192 tokens over contexts up to 4,352. Tolerances: float32 2e-5 (atol
and rtol); fp16 and bf16 2e-2 (the kernel rounds the softmax weights to the cache dtype before P @ V, as
flash attention does), plus a relative-norm error below 1e-2 on the GPU.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.prefill_attention import _paged_prefill_attention, paged_prefill_attention

TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def reference_prefill(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks]
    query_start_loc: torch.Tensor,  # [num_seqs + 1]
    seq_lens: torch.Tensor,  # [num_seqs]
    scale: float,
    rows_per_pass: int = 2048,
) -> torch.Tensor:
    """[num_tokens, num_heads, head_dim] float32; rows of no sequence stay zero. Query rows are taken
    rows_per_pass at a time so an 8k-token chunk's scores fit comfortably in GPU memory."""
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_heads, head_dim, dtype=torch.float32, device=query.device)
    starts = query_start_loc.tolist()
    for i, length in enumerate(seq_lens.tolist()[: len(starts) - 1]):
        q_len = starts[i + 1] - starts[i]
        positions = torch.arange(length, device=query.device)
        blocks = block_tables[i, positions // block_size].long()
        keys = key_cache[blocks, positions % block_size].float()  # [length, num_kv_heads, head_dim]
        values = value_cache[blocks, positions % block_size].float()
        keys = keys.repeat_interleave(group, dim=1)  # [length, num_heads, head_dim]
        values = values.repeat_interleave(group, dim=1)
        for first in range(0, q_len, rows_per_pass):
            rows = torch.arange(first, min(first + rows_per_pass, q_len), device=query.device)
            q = query[starts[i] + rows].float()  # [rows, num_heads, head_dim]
            scores = torch.einsum("qhd,lhd->hql", q, keys) * scale
            row_positions = length - q_len + rows  # [rows]: the last key each row may see
            hidden = positions[None, :] > row_positions[:, None]  # [rows, length]
            scores = scores.masked_fill(hidden[None], float("-inf"))
            out[starts[i] + rows] = torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), values)
    return out


def make_inputs(
    chunks: list[tuple[int, int]],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """(query, kv_cache [2, num_blocks, ...], block_tables, query_start_loc, seq_lens, max_query_len) for
    chunks of (tokens cached before, chunk length).

    The cache holds random K/V for every position, this chunk's included (store_kv has run). Blocks are
    handed out in a random order with spare noise blocks; query is a strided view into a fused-qkv-like
    buffer [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim].
    """
    generator = torch.Generator().manual_seed(seed)
    lens = [cached + q_len for cached, q_len in chunks]
    blocks_per_seq = [-(-length // block_size) for length in lens]
    num_blocks = sum(blocks_per_seq) + 3
    order = torch.randperm(num_blocks, generator=generator)
    block_tables = torch.zeros(len(chunks), max(blocks_per_seq + [1]), dtype=torch.int32)
    used = 0
    for i, count in enumerate(blocks_per_seq):
        block_tables[i, :count] = order[used : used + count]
        used += count
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    num_heads = num_kv_heads * group
    q_lens = [q_len for _, q_len in chunks]
    num_tokens = sum(q_lens)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    query = qkv.to(device=device, dtype=dtype)[:, : num_heads * head_dim].view(
        num_tokens, num_heads, head_dim
    )
    starts = torch.tensor([0] + q_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return (
        query,
        kv_cache.to(device=device, dtype=dtype),
        block_tables.to(device),
        starts.to(device),
        torch.tensor(lens, dtype=torch.int32, device=device),
        max(q_lens + [0]),
    )


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    tolerance = TOLERANCE[dtype]
    torch.testing.assert_close(actual.float(), expected, atol=tolerance, rtol=tolerance)


def run_case(chunks, num_kv_heads, group, head_dim, block_size, dtype, device, tile=None, seed=0):
    query, kv_cache, block_tables, starts, seq_lens, max_query_len = make_inputs(
        chunks, num_kv_heads, group, head_dim, block_size, dtype, device, seed
    )
    scale = head_dim**-0.5
    args = (query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, scale, max_query_len)
    if tile is None:
        out = paged_prefill_attention(*args)
    else:
        block_m, block_n = tile
        out = _paged_prefill_attention(
            *args, None, block_m=block_m, block_n=block_n, num_warps=4, num_stages=2
        )
    assert out.dtype == dtype and out.shape == query.shape
    expected = reference_prefill(query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, scale)
    return out, expected


def mixed_chunks(block_size: int) -> list[tuple[int, int]]:
    """(cached, chunk) pairs: a whole prompt, a chunk from mid-block after cached tokens, a 1-token chunk
    (one decode row), a chunk that crosses several block boundaries, a 1-token prompt."""
    return [
        (0, 2 * block_size + 5),
        (block_size + block_size // 2, 7),
        (3 * block_size + 1, 1),
        (block_size // 2 + 1, 3 * block_size),
        (0, 1),
    ]


# (dtype, num_kv_heads, group, head_dim, block_size, tile: None for the launcher's default, else
# (block_m, block_n)). Small tiles put the diagonal across several K/V tiles and a chunk over several
# query tiles; the default fp16 tile is the one bf16/fp16 use on the GPU.
CPU_CASES = [
    (torch.float32, 2, 1, 32, 4, None),
    (torch.float32, 1, 2, 16, 16, (16, 16)),
    (torch.float32, 2, 6, 32, 4, (16, 16)),
    (torch.float32, 1, 7, 16, 16, None),
    (torch.float16, 1, 6, 32, 16, None),
    (torch.float16, 2, 2, 16, 4, (32, 16)),
    (torch.float16, 1, 7, 64, 4, (16, 32)),
]


@pytest.mark.parametrize("dtype,num_kv_heads,group,head_dim,block_size,tile", CPU_CASES)
def test_mixed_chunks_match_reference(dtype, num_kv_heads, group, head_dim, block_size, tile, device):
    out, expected = run_case(
        mixed_chunks(block_size), num_kv_heads, group, head_dim, block_size, dtype, device, tile
    )
    assert_close(out, expected, dtype)


def test_long_cached_context_and_tile_edges(device):
    """A chunk whose first row sits exactly on a K/V tile edge, one and two positions before it (the last
    tile that must still be masked), and context long enough for several unmasked tiles first."""
    chunks = [(32, 16), (31, 17), (30, 10), (95, 33), (0, 64)]
    out, expected = run_case(chunks, 1, 2, 16, 8, torch.float32, device, tile=(16, 16))
    assert_close(out, expected, torch.float32)


def test_out_is_written_in_place_and_extra_rows_are_ignored(device):
    """out= (a strided view) is written in place; rows owned by no sequence stay as they were;
    block_tables/seq_lens may have more rows than sequences and all index tensors may be int64."""
    dtype, head_dim, block_size = torch.float16, 32, 16
    chunks = [(5, 9), (0, 20), (40, 1)]
    query, kv_cache, block_tables, starts, seq_lens, max_query_len = make_inputs(
        chunks, 2, 2, head_dim, block_size, dtype, device
    )
    # Drop the last sequence from the launch but keep its table/length rows, and its query row.
    starts = starts[:3].long()
    block_tables, seq_lens = block_tables.long(), seq_lens.long()
    buffer = torch.full(
        (query.shape[0], query.shape[1], 2 * head_dim), float("nan"), dtype=dtype, device=device
    )
    out = buffer[..., :head_dim]
    result = paged_prefill_attention(
        query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, 0.3, max_query_len, out=out
    )
    assert result.data_ptr() == out.data_ptr()
    expected = reference_prefill(query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, 0.3)
    assert_close(out[:29], expected[:29], dtype)
    assert torch.isnan(out[29:]).all(), "a row of no sequence must be left untouched"
    assert torch.isnan(buffer[..., head_dim:]).all(), "out's neighbours in its buffer must be untouched"


def test_no_sequences_is_a_no_op(device):
    query, kv_cache, block_tables, _, seq_lens, _ = make_inputs([(0, 4)], 1, 1, 16, 4, torch.float32, device)
    starts = torch.zeros(1, dtype=torch.int32, device=device)
    out = torch.full_like(query, 7.0)
    paged_prefill_attention(query[:0], kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, 0.25, 0)
    paged_prefill_attention(query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, 0.25, 0, out=out)
    assert torch.all(out == 7.0)


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
        (lambda a: {**a, "query": a["query"].int()}, "query dtype"),
        (
            lambda a: {**a, "key_cache": a["key_cache"][..., :8], "value_cache": a["value_cache"][..., :8]},
            "head_dim",
        ),
        (lambda a: {**a, "value_cache": a["value_cache"][:-1]}, "value_cache shape"),
        (lambda a: {**a, "key_cache": _strided_last_dim(a["key_cache"])}, "contiguous last dimension"),
        (lambda a: {**a, "query": _strided_last_dim(a["query"])}, "contiguous last dimension"),
        (
            lambda a: {**a, "key_cache": a["key_cache"][:, :3], "value_cache": a["value_cache"][:, :3]},
            "power of two",
        ),
        (lambda a: {**a, "query": a["query"][:, :3]}, "multiple of num_kv_heads"),
        (lambda a: {**a, "block_tables": a["block_tables"].float()}, "block_tables dtype"),
        (lambda a: {**a, "block_tables": a["block_tables"][:1]}, "block_tables must be"),
        (lambda a: {**a, "query_start_loc": a["query_start_loc"].float()}, "query_start_loc dtype"),
        (lambda a: {**a, "query_start_loc": a["query_start_loc"][None]}, "query_start_loc must be"),
        (lambda a: {**a, "seq_lens": a["seq_lens"].float()}, "seq_lens dtype"),
        (lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens must be"),
        (lambda a: {**a, "max_query_len": 1000}, "max_query_len"),
        (lambda a: {**a, "max_query_len": 3.0}, "max_query_len"),
        (lambda a: {**a, "out": a["query"].half()}, "out must match"),
        (lambda a: {**a, "out": a["query"][:-1]}, "out must match"),
    ],
)
def test_launcher_rejects_bad_inputs(change, message, device):
    query, kv_cache, block_tables, starts, seq_lens, max_query_len = make_inputs(
        [(0, 5), (4, 9)], 2, 2, 16, 4, torch.float32, device
    )
    arguments = {
        "query": query,
        "key_cache": kv_cache[0],
        "value_cache": kv_cache[1],
        "block_tables": block_tables,
        "query_start_loc": starts,
        "seq_lens": seq_lens,
        "scale": 0.25,
        "max_query_len": max_query_len,
        "out": None,
    }
    with pytest.raises(ValueError, match=message):
        paged_prefill_attention(**change(arguments))


def test_rejects_non_power_of_two_head_dim(device):
    query, kv_cache, block_tables, starts, seq_lens, max_len = make_inputs(
        [(0, 5)], 1, 1, 24, 4, torch.float32, device
    )
    with pytest.raises(ValueError, match="head_dim must be one of"):
        paged_prefill_attention(query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, 0.2, max_len)


# ---- CUDA: the shapes that matter, in bf16 and fp16 -------------------------------------------------

# (cached, chunk) mixes, each one launch: a 8k prompt; 8 sequences of mixed chunk/context sizes summing
# to ~8k tokens (contexts up to 4,352, block and tile boundaries, 1-token chunks); 16 short prompts.
GPU_MIXES = {
    "one_8k_prompt": [(0, 8192)],
    "mixed_8": [
        (0, 4096),
        (3072, 1024),
        (1024, 1280),
        (4351, 1),
        (17, 1000),
        (255, 257),
        (0, 300),
        (33, 227),
    ],
    "chunks_at_4k": [(3072, 1024), (3328, 1024), (1, 4351), (4095, 257)],
    "short_prompts": [(0, 512)] * 12 + [(0, 1), (0, 15), (0, 16), (0, 17)],
}
# (dtype, head_dim, group, num_kv_heads)
GPU_SHAPES = [
    (torch.bfloat16, 128, 6, 2),
    (torch.bfloat16, 64, 8, 4),
    (torch.bfloat16, 128, 7, 2),
    (torch.bfloat16, 128, 1, 4),
    (torch.float16, 128, 8, 8),
    (torch.float16, 64, 6, 2),
    (torch.bfloat16, 256, 4, 2),
    (torch.float32, 128, 6, 2),
]


@pytest.mark.gpu
@pytest.mark.parametrize("mix", sorted(GPU_MIXES))
@pytest.mark.parametrize("dtype,head_dim,group,num_kv_heads", GPU_SHAPES)
def test_gpu_matches_reference(dtype, head_dim, group, num_kv_heads, mix):
    device = torch.device("cuda")
    out, expected = run_case(GPU_MIXES[mix], num_kv_heads, group, head_dim, 16, dtype, device, seed=len(mix))
    assert_close(out, expected, dtype)
    relative = (out.float() - expected).norm() / expected.norm()
    assert relative < (1e-2 if dtype != torch.float32 else 1e-4), f"relative error {relative:.2e}"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [(64, 32, 4, 2), (128, 128, 8, 2), (64, 64, 4, 4)])
def test_gpu_other_tiles_match_reference(tile):
    """Tiles the benchmark sweep may pick must be correct too."""
    device = torch.device("cuda")
    dtype, head_dim = torch.bfloat16, 128
    query, kv_cache, block_tables, starts, seq_lens, max_len = make_inputs(
        GPU_MIXES["mixed_8"], 2, 6, head_dim, 16, dtype, device
    )
    block_m, block_n, num_warps, num_stages = tile
    out = _paged_prefill_attention(
        query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, head_dim**-0.5, max_len, None,
        block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    expected = reference_prefill(
        query, kv_cache[0], kv_cache[1], block_tables, starts, seq_lens, head_dim**-0.5
    )
    assert_close(out, expected, dtype)

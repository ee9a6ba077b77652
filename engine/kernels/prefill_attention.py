"""Paged prefill attention (FlashAttention-2 style, GQA-packed): every prompt chunk of a step in one launch.

The Triton attention backend calls `paged_prefill_attention` for the prefill rows of a batch, after
store_kv has written the step's K/V into the paged cache. K/V are read in place through the block table,
so a chunk that starts mid-sequence sees its cached context without a gather. The torch attention backend
(engine/attention/torch_backend.py) is the reference it must agree with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import check_index, check_out, check_query_against_cache


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_DIM], query's dtype
    acc,  # [BLOCK_M, HEAD_DIM] float32, unnormalised output
    m_i,  # [BLOCK_M] float32, running max of base-2 scores
    l_i,  # [BLOCK_M] float32, running sum of exp2(score - m_i)
    tile_start,  # first context position of this K/V tile
    row_pos,  # [BLOCK_M] context position of each query row (the last key it may see)
    last_pos,  # the tile's largest row position: no key past it is read
    block_table_row,
    key_base,
    value_base,
    qk_scale,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CAUSAL_MASK: tl.constexpr,  # False: every key of the tile is visible to every row, nothing to mask
    DOT_PRECISION: tl.constexpr,
):
    """One online-softmax step over the BLOCK_N context positions from tile_start; returns (acc, m_i, l_i)."""
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    tokens = tile_start + offs_n  # [BLOCK_N] context positions
    # Per-token slot lookup, so BLOCK_N is independent of the cache's block size.
    if CAUSAL_MASK:
        mask_n = tokens <= last_pos
        block_ids = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
    else:
        block_ids = tl.load(block_table_row + tokens // BLOCK_SIZE).to(tl.int64)
    slot_in_block = tokens % BLOCK_SIZE
    key_rows = block_ids * stride_k_block + slot_in_block * stride_k_slot  # [BLOCK_N], int64
    value_rows = block_ids * stride_v_block + slot_in_block * stride_v_slot
    if CAUSAL_MASK:
        k = tl.load(key_base + key_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        k = tl.load(key_base + key_rows[:, None] + offs_d[None, :])
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N], unscaled
    # Every row has seen a visible key by now (the first tile is never above any row's diagonal), so
    # m_new is finite and no row turns NaN, even where this tile hides all of its keys from a row.
    if CAUSAL_MASK:
        scores = tl.where(tokens[None, :] <= row_pos[:, None], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
    else:
        # The row maximum of the unscaled scores, scaled once (qk_scale > 0), and the scale applied in
        # the exponent's multiply-add: one pass over the tile's scores instead of two.
        m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if CAUSAL_MASK:
        v = tl.load(value_base + value_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(value_base + value_rows[:, None] + offs_d[None, :])
    # The rescaled accumulator goes into the dot as its accumulator: the tensor cores add P V to it,
    # with no separate pass over the [BLOCK_M, HEAD_DIM] tile.
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc, m_new, l_i


# The step's metadata is read a scalar at a time (offsets, lengths) or gathered (a block id a token), so
# no load gains by its pointers' alignment; and an eager step's chunks start anywhere in the step
# buffers (past its decodes): their alignment is not specialised, so that such a step's slices compile
# no variant of their own while serving.
@triton.jit(do_not_specialize_on_alignment=["block_tables_ptr", "query_start_loc_ptr", "seq_lens_ptr"])
def _prefill_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [>= num_seqs, max_blocks_per_seq]
    query_start_loc_ptr,  # [num_seqs + 1]
    seq_lens_ptr,  # [>= num_seqs]
    out_ptr,  # [num_tokens, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2 so exp2 can be used
    stride_q_token,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_start,
    stride_len,
    stride_o_token,
    stride_o_head,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    TOKENS_PER_TILE: tl.constexpr,  # BLOCK_M // GROUP_SIZE query tokens per program
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_M: tl.constexpr,  # rows of a program: TOKENS_PER_TILE tokens x GROUP_SIZE heads, padded
    BLOCK_N: tl.constexpr,  # context positions per K/V tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32 rounding), else "tf32" (unused)
):
    """One program: TOKENS_PER_TILE query tokens of one sequence, all GROUP_SIZE query heads of one KV head.

    Row r of the tile is token r // GROUP_SIZE, head r % GROUP_SIZE, so each K/V tile is loaded once for
    the whole group. Why pack heads rather than tokens alone: K/V traffic per FLOP is the same (it is set
    by BLOCK_M), but short chunks fill the tile (a 1-token chunk of group 6 uses 6 rows, not 1 of each of
    6 programs); a long chunk loses at most BLOCK_M % GROUP_SIZE padding rows (2 of 128 for group 6).
    K/V tiles below the tile's first row position are visible to every row and run unmasked; only the
    tiles that cross the diagonal are masked; none above it are read.
    """
    # Heaviest tiles (the last tokens of a chunk see the most context) are launched first, so the
    # short ones fill in the tail of the grid.
    tile = tl.num_programs(0) - 1 - tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq * stride_start).to(tl.int32)
    q_len = tl.load(query_start_loc_ptr + (seq + 1) * stride_start).to(tl.int32) - q_start
    tile_first = tile * TOKENS_PER_TILE  # chunk-relative index of the tile's first token
    if tile_first >= q_len:  # past this sequence's chunk (the grid is sized by the longest one)
        return
    seq_len = tl.load(seq_lens_ptr + seq * stride_len).to(tl.int32)
    tile_tokens = tl.minimum(q_len - tile_first, TOKENS_PER_TILE)
    first_pos = seq_len - q_len + tile_first  # context position of the tile's first token
    last_pos = first_pos + tile_tokens - 1

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    token_in_tile = offs_m // GROUP_SIZE  # [BLOCK_M]
    heads = kv_head * GROUP_SIZE + offs_m % GROUP_SIZE  # [BLOCK_M] query head of each row
    # Also false for the padding rows past TOKENS_PER_TILE * GROUP_SIZE.
    mask_m = token_in_tile < tile_tokens
    # Rows past the chunk's end take the last valid position: they compute like a real row (no NaN)
    # and are never stored.
    row_pos = tl.minimum(first_pos + token_in_tile, last_pos)
    rows = (q_start + tile_first + token_in_tile).to(tl.int64)  # [BLOCK_M] index into query/out
    q = tl.load(
        query_ptr + rows[:, None] * stride_q_token + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_m[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    block_table_row = block_tables_ptr + seq * stride_bt_seq
    key_base = key_cache_ptr + kv_head * stride_k_head
    value_base = value_cache_ptr + kv_head * stride_v_head

    # Positions [0, unmasked_end) are <= first_pos, so every row sees all of them.
    unmasked_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    for tile_start in range(0, unmasked_end, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile_start, row_pos, last_pos, block_table_row, key_base, value_base,
            qk_scale, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, DOT_PRECISION,
        )  # fmt: skip
    # The diagonal: tiles that start at or before last_pos; the first one starts <= first_pos.
    for tile_start in range(unmasked_end, last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, tile_start, row_pos, last_pos, block_table_row, key_base, value_base,
            qk_scale, stride_k_block, stride_k_slot, stride_v_block, stride_v_slot,
            HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, DOT_PRECISION,
        )  # fmt: skip

    result = acc / l_i[:, None]  # l_i >= 1 on every row: its own maximum contributes exp2(0)
    out_ptrs = out_ptr + rows[:, None] * stride_o_token + heads[:, None] * stride_o_head + offs_d[None, :]
    tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask_m[:, None])


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    max_query_len: int,
    out: torch.Tensor | None,
) -> None:
    check_query_against_cache(query, key_cache, value_cache)
    check_index("query_start_loc", query_start_loc, 1, 1, query)
    num_seqs = query_start_loc.shape[0] - 1
    check_index("block_tables", block_tables, 2, num_seqs, query)
    check_index("seq_lens", seq_lens, 1, num_seqs, query)
    num_tokens = query.shape[0]
    if not isinstance(max_query_len, int) or not 0 <= max_query_len <= num_tokens:
        raise ValueError(
            f"max_query_len must be an int in [0, num_tokens ({num_tokens})], got {max_query_len!r}"
        )
    check_out(out, query)


def _default_tile(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages), chosen by measurement on an H100 (2026-12-06);
    `python -m engine.kernels.bench_prefill --sweep` measures the others.

    bf16/fp16 at head_dim 128: 64 rows x 64 keys, 4 warps, 2 stages (Q 16 KiB + 2 x (K 16 KiB + V 16 KiB)
    = 80 KiB of shared memory). A step's prompt is often one chunk of ~1,000 tokens: with GQA group 6 a
    128-row tile holds 21 tokens, so 1,024 tokens make 98 programs for 132 SMs, and the longest (the last
    tokens, which see the whole context) sets much of the kernel's time; 64-row tiles make twice the
    programs, each step over 64 keys half the work. Replayed in graphs it ran 0.7-18% faster than
    128 x 64 / 8 warps / 3 stages on 7 of 8 cases (most on one short prompt; 0.4% slower on 8 x 1,024 at
    3,072 cached); a mixed step of 128 decodes + 1,024 prompt tokens took 8.68 vs 8.79 ms; closed loops
    of 128 in flight, three interleaved pairs: 12,743 vs 12,623 output tok/s (+1%). Where many long
    prompts fill the GPU (2 x 4,096) the 128-row tile's higher FLOP per loaded byte matters more: there
    the two are within 1%. Splitting a long tile's keys over programs did not pay (PERFORMANCE.md).
    head_dim <= 64 halves every buffer; 256 halves the tile. float32 (tests and the interpreter) computes
    its dots on FMA units: 32 x 32 tiles avoid register spills."""
    if dtype == torch.float32:
        return 32, 32, 4, 2
    if head_dim >= 256:
        return 64, 32, 4, 2
    if head_dim >= 128:
        return 64, 64, 4, 2
    return 128, 64, 4, 3


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Causal attention of every prompt chunk of a step over its paged context; returns out.

    query: [num_tokens, num_heads, head_dim], bf16/fp16 (fp32 too): the step's prefill tokens, sequences
        packed one after another; any strides with the last dim contiguous (a view into the qkv output).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as query, last
        dim contiguous; may be strided views (kv_cache[0], kv_cache[1]). This step's K/V must already
        be in the cache (store_kv runs first).
    block_tables: [>= num_seqs, max_blocks_per_seq] int32 (int64 accepted): row i lists sequence i's blocks.
    query_start_loc: [num_seqs + 1] int32 (int64 accepted): sequence i owns query rows
        query_start_loc[i]:query_start_loc[i + 1] (row indices into query: a caller may pass the offsets
        of a step's later sequences and the whole query, and only their rows are computed).
    seq_lens: [>= num_seqs] int32 (int64 accepted): sequence i's context length after this step (tokens
        cached earlier + this chunk). Query row j of sequence i sits at position
        seq_lens[i] - q_len_i + j and attends to positions 0..that position inclusive.
    scale: softmax scale (usually head_dim ** -0.5).
    max_query_len: host int, the longest chunk (sizes the grid; shorter chunks' extra programs exit).
    out: [num_tokens, num_heads, head_dim], query's dtype, last dim contiguous, written in place if given.

    Rows of query not owned by any sequence are left untouched in out. No host-device synchronisation.
    check=False skips the argument checks (host time), for callers whose tensors are their own.
    """
    block_m, block_n, num_warps, num_stages = _default_tile(
        query.shape[-1] if query.dim() else 0, query.dtype
    )
    return _paged_prefill_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        scale,
        max_query_len,
        out,
        block_m=block_m,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        check=check,
    )


def _paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_query_len: int,
    out: torch.Tensor | None,
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    check: bool = True,
) -> torch.Tensor:
    """paged_prefill_attention with the tile configuration spelled out (tests and the benchmark sweep).
    block_m is raised to the group size (rounded to a power of two) where it is smaller."""
    if check:
        _check_inputs(
            query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, max_query_len, out
        )
        for name, value in (("block_m", block_m), ("block_n", block_n)):
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = query_start_loc.shape[0] - 1
    group_size = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0 or max_query_len == 0:
        return out

    block_m = max(block_m, triton.next_power_of_2(group_size))
    tokens_per_tile = block_m // group_size
    log2e = 1.4426950408889634
    grid = (triton.cdiv(max_query_len, tokens_per_tile), num_seqs, num_kv_heads)
    _prefill_kernel[grid](
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        out,
        float(scale) * log2e,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        query_start_loc.stride(0),
        seq_lens.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=group_size,
        TOKENS_PER_TILE=tokens_per_tile,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out

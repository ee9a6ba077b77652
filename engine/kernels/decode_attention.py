"""Paged decode attention (flash-decoding, GQA-aware): one new query token per sequence against its cache.

The Triton attention backend calls `paged_decode_attention` for a step of a few decodes alone (one
sequence, a handful; engine.kernels.planned_decode_attention serves the rest), with `num_splits` from
`choose_num_splits` (fixed per CUDA-graph batch size). `attend_context`, the online softmax over one
split, serves both kernels. K/V are read in place from the
paged cache through the block table; nothing is gathered or upcast in memory. The torch attention backend
(engine/attention/torch_backend.py) is the reference it must agree with.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import check_index, check_out, check_query_against_cache

# choose_num_splits: a split shorter than this spends more on its merge than it saves, and no more than
# MAX_SPLITS because stage 2 reads every split's partial output back.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 16
# Aim for this many stage-1 programs per SM: a single 4-warp program cannot keep enough loads in flight
# to saturate an SM's share of HBM bandwidth.
PROGRAMS_PER_SM = 3


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int = 132) -> int:
    """How many context splits per (sequence, KV head) so the grid fills the GPU.

    A pure function of its arguments (the caller fixes it per CUDA-graph batch size): >= 1, so that
    num_seqs * num_kv_heads * splits reaches about PROGRAMS_PER_SM programs per SM, but each split covers
    at least MIN_SPLIT_TOKENS of max_context and there are at most MAX_SPLITS. Example (132 SMs, 2 KV
    heads): batch 1 at 4,096 tokens -> 16 splits; batch 64 at 1,024 -> 4; batch 256 -> 1.
    """
    programs = max(num_seqs * num_kv_heads, 1)
    wanted = triton.cdiv(PROGRAMS_PER_SM * num_sms, programs)
    by_length = max_context // MIN_SPLIT_TOKENS
    return max(1, min(wanted, by_length, MAX_SPLITS))


@triton.jit
def attend_context(
    q,  # [BLOCK_G, HEAD_DIM]: one KV head's group of query heads (padded rows zero)
    key_base,  # key cache pointer at this KV head
    value_base,
    block_table_row,  # the sequence's row of the block table
    start,  # context positions [start, end) of this split
    end,
    qk_scale,
    stride_k_block,
    stride_k_slot,
    stride_v_block,
    stride_v_slot,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of q over one split of a paged context, BLOCK_N tokens a tile: (m, l, acc), the
    running max of base-2 scores, the sum of exp2(score - m), and the unnormalised P @ V. Both decode
    kernels (this module's and engine.kernels.planned_decode_attention's) stream their splits through it.
    An empty split (start >= end) returns l = 0."""
    offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)  # running max of base-2 scores
    l_i = tl.zeros([BLOCK_G], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + offs_n  # [BLOCK_N] context positions
        mask_n = tokens < end
        # Per-token slot lookup, so BLOCK_N is independent of the cache's block size.
        block_ids = tl.load(block_table_row + tokens // BLOCK_SIZE, mask=mask_n, other=0).to(tl.int64)
        slot_in_block = tokens % BLOCK_SIZE
        key_rows = block_ids * stride_k_block + slot_in_block * stride_k_slot  # [BLOCK_N], int64
        k = tl.load(key_base + key_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(mask_n[None, :], scores, float("-inf"))
        # Each tile has at least one valid token, so m_new is finite and no row becomes NaN.
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        value_rows = block_ids * stride_v_block + slot_in_block * stride_v_slot
        v = tl.load(value_base + value_rows[:, None] + offs_d[None, :], mask=mask_n[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [>= num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [>= num_seqs]
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32 (unused if DIRECT_OUTPUT)
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, base-2 log-sum-exp (unused if DIRECT_OUTPUT)
    out_ptr,  # [num_seqs, num_heads, head_dim] (used only if DIRECT_OUTPUT)
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2 so exp2 can be used
    num_splits,
    stride_q_seq,
    stride_q_head,
    stride_k_block,
    stride_k_slot,
    stride_k_head,
    stride_v_block,
    stride_v_slot,
    stride_v_head,
    stride_bt_seq,
    stride_len,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_lse_seq,
    stride_lse_head,
    stride_o_seq,
    stride_o_head,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP_SIZE padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # tokens per tile
    DIRECT_OUTPUT: tl.constexpr,  # num_splits == 1: normalise and write the output, no merge pass
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32 rounding), else "tf32" (unused)
):
    """One program: all query heads of one KV head, over one split of one sequence's context."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq * stride_len).to(tl.int32)
    # Every split but the last covers a whole number of tiles, so only a split's last tile is ragged.
    # Short contexts leave the trailing splits empty (start >= end): they write l = 0, lse = -inf.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + offs_g  # [BLOCK_G] query heads served by this KV head
    q = tl.load(
        query_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
        mask=mask_g[:, None],
        other=0.0,
    )  # [BLOCK_G, HEAD_DIM]; padded rows are zero and are never stored

    m_i, l_i, acc = attend_context(
        q,
        key_cache_ptr + kv_head * stride_k_head,
        value_cache_ptr + kv_head * stride_v_head,
        block_tables_ptr + seq * stride_bt_seq,
        start,
        end,
        qk_scale,
        stride_k_block,
        stride_k_slot,
        stride_v_block,
        stride_v_slot,
        BLOCK_G,
        HEAD_DIM,
        BLOCK_SIZE,
        BLOCK_N,
        DOT_PRECISION,
    )

    # An empty split (or seq_len 0) has l_i = 0: it outputs zeros and lse = -inf, never NaN.
    l_safe = tl.where(l_i > 0.0, l_i, 1.0)
    result = acc / l_safe[:, None]  # [BLOCK_G, HEAD_DIM]
    if DIRECT_OUTPUT:
        out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
    else:
        partial_ptrs = (
            partial_out_ptr
            + seq * stride_po_seq
            + heads[:, None] * stride_po_head
            + split * stride_po_split
            + offs_d[None, :]
        )
        tl.store(partial_ptrs, result, mask=mask_g[:, None])
        lse = m_i + tl.log2(l_safe)  # -inf where the split was empty
        tl.store(partial_lse_ptr + seq * stride_lse_seq + heads * stride_lse_head + split, lse, mask=mask_g)


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr,  # [num_seqs, num_heads, num_splits, head_dim] float32
    partial_lse_ptr,  # [num_seqs, num_heads, num_splits] float32, base 2
    out_ptr,  # [num_seqs, num_heads, head_dim]
    num_splits,
    stride_po_seq,
    stride_po_head,
    stride_po_split,
    stride_lse_seq,
    stride_lse_head,
    stride_o_seq,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,  # num_splits padded to a power of two
):
    """One program per (sequence, query head): out = sum_s w_s * partial_s / sum_s w_s, w_s = 2^(lse_s - max)."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_s = offs_s < num_splits
    lse = tl.load(
        partial_lse_ptr + seq * stride_lse_seq + head * stride_lse_head + offs_s,
        mask=mask_s,
        other=float("-inf"),
    )
    lse_max = tl.max(lse, 0)
    # All splits empty (seq_len 0): every weight must come out 0, not exp2(-inf - -inf) = NaN.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [BLOCK_S]; 0 for empty and padded splits
    partial = tl.load(
        partial_out_ptr
        + seq * stride_po_seq
        + head * stride_po_head
        + offs_s[:, None] * stride_po_split
        + offs_d[None, :],
        mask=mask_s[:, None],
        other=0.0,
    )  # [BLOCK_S, HEAD_DIM]
    total = tl.sum(weights, 0)
    merged = tl.sum(weights[:, None] * partial, 0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + seq * stride_o_seq + head * stride_o_head + offs_d, merged.to(out_ptr.dtype.element_ty)
    )


def check_decode_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    out: torch.Tensor | None,
) -> None:
    check_query_against_cache(query, key_cache, value_cache)
    num_seqs = query.shape[0]
    check_index("block_tables", block_tables, 2, num_seqs, query)
    check_index("seq_lens", seq_lens, 1, num_seqs, query)
    if not isinstance(num_splits, int) or num_splits < 1:
        raise ValueError(f"num_splits must be an int >= 1, got {num_splits!r}")
    check_out(out, query)


def decode_tile(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages) for stage 1, from compiling for sm_90 (triton 3.9): at 64 tokens x
    128 dims, 96 registers and 39 KiB of shared memory a program, so about five programs share an SM and
    keep ~160 KiB of K/V in flight. num_stages 3 also prefetches the block-table entries a tile ahead.
    float32 (tests only) computes its dots on FMA units: 16-token tiles avoid register spills.
    `python -m engine.kernels.bench_attention --sweep` measures the alternatives on the device."""
    if dtype == torch.float32:
        return 16, 4, 3
    if head_dim >= 256:
        return 32, 4, 3
    return 64, 4, 3


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context; returns out.

    query: [num_seqs, num_heads, head_dim], bf16/fp16 (fp32 too), any strides with the last dim contiguous.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as query, last dim
        contiguous; may be strided views (kv_cache[0], kv_cache[1] of [2, num_blocks, ...]).
    block_tables: [>= num_seqs, max_blocks_per_seq] int32 (int64 accepted): row i lists sequence i's blocks.
    seq_lens: [>= num_seqs] int32 (int64 accepted): context length of sequence i including the current
        token, whose K/V are already in the cache; 0 marks a padding row, whose output is zeros.
    scale: softmax scale (usually head_dim ** -0.5).
    num_splits: context splits per (sequence, KV head), from choose_num_splits; any value >= 1 is correct.
    out: [num_seqs, num_heads, head_dim], query's dtype, written in place if given.

    CUDA-graph safe: the grid is (num_seqs, num_kv_heads, num_splits) and each split's token range is
    derived inside the kernel from the loaded seq_len; no host-device synchronisation. check=False skips
    the argument checks (~20 us of host time a call), for callers whose tensors are their own.
    """
    block_n, num_warps, num_stages = decode_tile(query.shape[-1] if query.dim() else 0, query.dtype)
    return _paged_decode_attention(
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        scale,
        num_splits,
        out,
        block_n=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        check=check,
    )


def _paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None,
    *,
    block_n: int,
    num_warps: int,
    num_stages: int,
    check: bool = True,
) -> torch.Tensor:
    """paged_decode_attention with the tile configuration spelled out (tests and the benchmark sweep)."""
    if check:
        check_decode_inputs(query, key_cache, value_cache, block_tables, seq_lens, num_splits, out)
        if block_n < 16 or block_n & (block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    if num_seqs == 0:
        return out

    direct = num_splits == 1
    if direct:
        # Never read: any float32 tensor stands in for the scratch pointers.
        partial_out = partial_lse = out.new_empty(0, dtype=torch.float32)
        po_strides: tuple[int, ...] = (0, 0, 0)
        lse_strides: tuple[int, ...] = (0, 0)
    else:
        # Scratch per call (torch.empty is allowed under graph capture: the graph's pool owns it).
        partial_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )
        partial_lse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        po_strides = partial_out.stride()[:3]
        lse_strides = partial_lse.stride()[:2]

    log2e = 1.4426950408889634
    _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        partial_out,
        partial_lse,
        out,
        float(scale) * log2e,
        num_splits,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        seq_lens.stride(0),
        *po_strides,
        *lse_strides,
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=group_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DIRECT_OUTPUT=direct,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        _decode_merge_kernel[(num_seqs, num_heads)](
            partial_out,
            partial_lse,
            out,
            num_splits,
            *po_strides,
            *lse_strides,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_S=triton.next_power_of_2(num_splits),
            num_warps=4 if head_dim >= 128 else 2,
        )
    return out

"""Paged decode attention planned once a step: each sequence's context cut by its share of the step's tokens.

The Triton attention backend calls `planned_decode_attention` for the decodes of a step that carries
prompt chunks, or of PLANNED_MIN_DECODES decodes or more (engine.attention.triton_backend): there a
closed loop's contexts differ by 100x (16-token and 4,352-token sequences side by side), and
engine.kernels.decode_attention, one split count for every row of a graph, waits on its longest
sequence. A one-program kernel plans the step's work items on the device (row, start, end), every
layer's split kernel reads them, and the split of a row that finishes last merges the row: no merge
launch. A few decodes alone keep engine.kernels.decode_attention, which is faster for one sequence
(measured on an H100: the planned kernel is 0.73-0.90x there; level at uniform batches). The torch
attention backend (engine/attention/torch_backend.py) is the reference both must agree with.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.ceilings import num_sms
from engine.kernels.decode_attention import (
    MAX_SPLITS,
    MIN_SPLIT_TOKENS,
    attend_context,
    check_decode_inputs,
    decode_tile,
)


def planned_num_splits(max_context: int) -> int:
    """The most splits one sequence's context may be cut into: each of max_context at least
    MIN_SPLIT_TOKENS, at most MAX_SPLITS (a row's merge, run by its last split's program, reads every
    split back). The plan picks each sequence's own count from the step's lengths; a pure function of the
    longest context a caller may see, so fixed per captured graph. 4,096 tokens -> 16; 1,000 -> 3."""
    return max(1, min(max_context // MIN_SPLIT_TOKENS, MAX_SPLITS))


# The programs a SM (all KV heads together) that a step's tokens are shared among: one program streams
# its split at ~17 GB/s (an H100 read a lone 4,352-token context in 0.133 ms), so about 1.5 a SM keep
# HBM busy, and every split beyond that costs partial writes and a merge without reading faster (a
# uniform 128 x 1,024 step: 0.068 ms in two splits a sequence, 0.057 ms in one).
FILL_PER_SM = 1.5


def plan_rows_block(num_seqs: int) -> int:
    """The plan kernel's vector of rows: num_seqs padded to a power of two, at least 16, so that a step of
    a few rows shares the variant of 16 (compiled by the decode graphs' capture, as every larger bucket
    is) instead of compiling one of its own while serving."""
    return max(16, triton.next_power_of_2(num_seqs))


def fill_programs(num_kv_heads: int, num_sms: int) -> int:
    """The split kernel's programs a KV head that a step's tokens are shared among (FILL_PER_SM a SM over
    the KV heads): the plan's split length is the step's tokens over this many. The grid holds this many
    programs more than the rows, so that every item has one."""
    return max(1, int(FILL_PER_SM * num_sms / num_kv_heads))


@dataclass(frozen=True)
class DecodePlan:
    """The decode kernel's work items for one step's lengths (plan_decode): computed once a step, read by
    every layer's launch. programs: the split kernel's grid a KV head (fill + num_seqs, one an item at
    most). items: [programs, 4] int32 (row, start, end, split count of the row; row -1:
    none); split_counts: [2 * num_seqs] int32 (each row's split count, then its first item);
    arrivals: [num_seqs * num_kv_heads] int32, a row's splits finished so far (zeroed by the plan, put
    back to zero by the merge of each launch, so every layer's launch finds them at zero)."""

    items: torch.Tensor
    split_counts: torch.Tensor
    arrivals: torch.Tensor
    num_seqs: int
    num_splits: int
    programs: int


# A step's row and split counts, and its programs, are plain arguments (do_not_specialize), and BLOCK_R
# is at least 16: the kernel's variants are then its BLOCK_R buckets alone, which the decode graphs'
# capture (16 rows and up, every power of two to the largest) compiles at start-up. Specialised on
# the counts, it compiled about ten times while serving on a fresh H100 (closed loops of 8 to 256 in
# flight), each compile a stall of every request: over HTTP the first trial at 8 in flight made 2,280
# output tok/s, the two after it, with the variants cached, 2,978 and 2,811.
@triton.jit(do_not_specialize=["num_seqs", "num_splits", "fill", "programs"])
def _decode_plan_kernel(
    seq_lens_ptr,  # [>= num_seqs]
    plan_ptr,  # [programs, 4] int32 out: (row, start, end, split count of the row); row -1: no item
    split_counts_ptr,  # [2, num_seqs] int32 out: each row's split count and first item, for the merge
    arrivals_ptr,  # [num_seqs, num_kv_heads] int32 out: zeros (the split kernel counts its items in them)
    num_seqs,
    num_kv_heads,
    num_splits,  # the most splits of one sequence
    fill,  # the programs the step's tokens are shared among (fill_programs)
    programs,  # fill + num_seqs: the split kernel's grid
    stride_len,
    BLOCK_N: tl.constexpr,  # the split kernel's tile: splits are whole tiles but for a sequence's last
    BLOCK_R: tl.constexpr,  # plan_rows_block(num_seqs): the step's lengths are read as one vector
    MIN_SPLIT: tl.constexpr,  # tokens: no split is cut shorter, unless its sequence is
):
    """One program: the step's work items, a split of one sequence's context each, one a split program.

    Why balance: a step's contexts differ by 100x (a closed loop of the seed-mix holds 16-token and
    4,352-token sequences side by side), and one program per sequence (or a fixed split count for all)
    leaves the kernel waiting on its longest sequence's lone program while the other SMs idle. Each
    sequence is cut into splits of one target length, the step's tokens over `fill` programs (at least
    MIN_SPLIT, a whole number of tiles, at most num_splits a sequence): a sequence shorter than that
    stays whole (no merge), a longer one is shared out. The items number at most fill + sequences:
    sum(cdiv(len, target)) <= tokens / target + sequences. The longest item, not the longest
    sequence, then sets the split kernel's time. Once a step: every layer reads the same plan.
    """
    offs_r = tl.arange(0, BLOCK_R)
    rows = offs_r < num_seqs
    lens = tl.load(seq_lens_ptr + offs_r * stride_len, mask=rows, other=0).to(tl.int32)
    target = tl.cdiv(tl.maximum(tl.cdiv(tl.sum(lens, 0), fill), MIN_SPLIT), BLOCK_N) * BLOCK_N
    counts = tl.minimum(tl.cdiv(lens, target), num_splits)
    # Every split but the last covers a whole number of tiles, so only a sequence's last tile is ragged;
    # the rounding up can leave fewer splits than asked for (4,352 tokens in 16: 14 of 320), never an
    # empty one. 0 splits for an empty row.
    split_len = tl.maximum(tl.cdiv(tl.cdiv(lens, tl.maximum(counts, 1)), BLOCK_N) * BLOCK_N, BLOCK_N)
    counts = tl.cdiv(lens, split_len)
    firsts = tl.cumsum(counts, 0) - counts  # sequence r owns items firsts[r] .. firsts[r] + counts[r] - 1
    tl.store(split_counts_ptr + offs_r, counts, mask=rows)
    tl.store(split_counts_ptr + num_seqs + offs_r, firsts, mask=rows)
    for kv_head in range(0, num_kv_heads):
        tl.store(arrivals_ptr + offs_r * num_kv_heads + kv_head, tl.zeros([BLOCK_R], tl.int32), mask=rows)
    for split in range(0, num_splits):
        here = rows & (split < counts)
        items = (firsts + split) * 4
        start = split * split_len
        tl.store(plan_ptr + items, offs_r, mask=here)
        tl.store(plan_ptr + items + 1, start, mask=here)
        tl.store(plan_ptr + items + 2, tl.minimum(start + split_len, lens), mask=here)
        tl.store(plan_ptr + items + 3, counts, mask=here)
    total = tl.sum(counts, 0)
    offs_i = tl.arange(0, 128)
    for base in range(0, programs, 128):  # the programs past the items: none (128 a pass, even for 1 row)
        idle = base + offs_i
        tl.store(plan_ptr + idle * 4, tl.full([128], -1, tl.int32), mask=(idle >= total) & (idle < programs))


@triton.jit(do_not_specialize=["num_seqs"])  # one variant at every row count (see the plan kernel)
def _decode_split_kernel(
    query_ptr,  # [num_seqs, num_heads, head_dim]
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    block_tables_ptr,  # [>= num_seqs, max_blocks_per_seq]
    seq_lens_ptr,  # [>= num_seqs]
    plan_ptr,  # [programs, 4] int32, from _decode_plan_kernel
    split_counts_ptr,  # [2, num_seqs] int32, from the plan: each row's split count and first item
    arrivals_ptr,  # [num_seqs, num_kv_heads] int32, zeros on entry and on exit
    partial_out_ptr,  # [programs, num_heads, head_dim] float32: an item's output (unused if num_splits == 1)
    partial_lse_ptr,  # [programs, num_heads] float32, base-2 log-sum-exp (unused if num_splits == 1)
    out_ptr,  # [num_seqs, num_heads, head_dim]
    qk_scale,  # softmax scale * log2(e): scores are kept in base 2 so exp2 can be used
    num_seqs,
    num_kv_heads,
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
    stride_po_item,
    stride_po_head,
    stride_lse_item,
    stride_o_seq,
    stride_o_head,
    GROUP_SIZE: tl.constexpr,  # query heads per KV head
    BLOCK_G: tl.constexpr,  # GROUP_SIZE padded to a power of two >= 16 (tl.dot's minimum)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_N: tl.constexpr,  # tokens per tile
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (no TF32 rounding), else "tf32" (unused)
):
    """One program: the plan's item program_id(0) (a split of one sequence's context), all query heads of
    one KV head; program i also writes the zeros of row i where that row is empty (seq_len 0).

    A row of one split writes its output. A row of several writes each split's partial output and
    log-sum-exp, and the split that finishes last (a per-row, per-KV-head counter) merges them into
    the output: no second launch a layer, and a row's merge starts as soon as its splits are done."""
    item = tl.program_id(0)
    kv_head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    mask_g = offs_g < GROUP_SIZE
    heads = kv_head * GROUP_SIZE + offs_g  # [BLOCK_G] query heads served by this KV head

    # The row's emptiness is loaded first and used last, and the item's four fields in one load: the
    # first K/V load waits on one memory round trip for the item and one for the block table, no more.
    empty_row = tl.load(seq_lens_ptr + item * stride_len, mask=item < num_seqs, other=1) == 0
    offs_f = tl.arange(0, 4)
    fields = tl.load(plan_ptr + item * 4 + offs_f)  # row, start, end, split count of the row
    row = tl.sum(tl.where(offs_f == 0, fields, 0), 0)
    start = tl.sum(tl.where(offs_f == 1, fields, 0), 0)
    end = tl.sum(tl.where(offs_f == 2, fields, 0), 0)
    count = tl.sum(tl.where(offs_f == 3, fields, 0), 0)
    seq = tl.maximum(row, 0).to(tl.int64)

    if row >= 0:
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

        # An empty split has l_i = 0: it outputs zeros and lse = -inf, never NaN.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        result = acc / l_safe[:, None]  # [BLOCK_G, HEAD_DIM]
        if count == 1:  # the sequence's only split: its output, no merge
            out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
            tl.store(out_ptrs, result.to(out_ptr.dtype.element_ty), mask=mask_g[:, None])
        else:
            partial_ptrs = (
                partial_out_ptr + item * stride_po_item + heads[:, None] * stride_po_head + offs_d[None, :]
            )
            tl.store(partial_ptrs, result, mask=mask_g[:, None])
            lse = m_i + tl.log2(l_safe)  # -inf where the split was empty
            tl.store(partial_lse_ptr + item * stride_lse_item + heads, lse, mask=mask_g)
            # Every thread's stores are done before the count (the barrier), and the release half of
            # the atomic orders them before it for the program that reads them (its acquire half).
            tl.debug_barrier()
            arrivals = arrivals_ptr + seq * num_kv_heads + kv_head
            if tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu") == count - 1:
                tl.store(arrivals, 0)  # the row's last split: the next layer's launch counts from zero
                first = tl.load(split_counts_ptr + num_seqs + seq).to(tl.int64)
                # The partials were written by other SMs: read them past this SM's L1 (".cg").
                lse_max = tl.full([BLOCK_G], float("-inf"), tl.float32)
                for s in range(0, count):
                    lse_s = tl.load(
                        partial_lse_ptr + (first + s) * stride_lse_item + heads,
                        mask=mask_g,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    lse_max = tl.maximum(lse_max, lse_s)
                weight_sum = tl.zeros([BLOCK_G], tl.float32)
                merged = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
                for s in range(0, count):
                    lse_s = tl.load(
                        partial_lse_ptr + (first + s) * stride_lse_item + heads,
                        mask=mask_g,
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    weight = tl.exp2(lse_s - lse_max)  # some split holds tokens: lse_max is finite
                    partial = tl.load(
                        partial_out_ptr
                        + (first + s) * stride_po_item
                        + heads[:, None] * stride_po_head
                        + offs_d[None, :],
                        mask=mask_g[:, None],
                        other=0.0,
                        cache_modifier=".cg",
                    )
                    merged += weight[:, None] * partial
                    weight_sum += weight
                out_ptrs = out_ptr + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
                tl.store(
                    out_ptrs,
                    (merged / weight_sum[:, None]).to(out_ptr.dtype.element_ty),
                    mask=mask_g[:, None],
                )

    if empty_row:
        zeros = tl.zeros([BLOCK_G, HEAD_DIM], out_ptr.dtype.element_ty)
        out_ptrs = out_ptr + item * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :]
        tl.store(out_ptrs, zeros, mask=mask_g[:, None])


def plan_decode(
    query: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int,
    num_kv_heads: int,
    *,
    fill: int | None = None,
    block_n: int | None = None,
) -> DecodePlan:
    """The work items of planned_decode_attention for query's rows and these lengths (read on the device:
    no synchronisation; CUDA-graph safe, the plan's buffers are fixed by the shapes). A caller with many
    layers plans once a step and hands the plan to each launch; a launch without one plans itself.
    fill: the programs a KV head the step's tokens are shared among (default fill_programs; >= 1);
    block_n: the split kernel's tile (default its own for query's head_dim and dtype)."""
    num_seqs = query.shape[0]
    if fill is None:
        fill = fill_programs(num_kv_heads, num_sms(query.device.index))
    if fill < 1:
        raise ValueError(f"fill must be at least 1, got {fill}")
    programs = fill + num_seqs
    if block_n is None:
        block_n = decode_tile(query.shape[-1], query.dtype)[0]
    items = torch.empty((programs, 4), dtype=torch.int32, device=query.device)
    split_counts = torch.empty(2 * max(num_seqs, 1), dtype=torch.int32, device=query.device)
    arrivals = torch.empty(max(num_seqs, 1) * num_kv_heads, dtype=torch.int32, device=query.device)
    if num_seqs:
        _decode_plan_kernel[(1,)](
            seq_lens,
            items,
            split_counts,
            arrivals,
            num_seqs,
            num_kv_heads,
            num_splits,
            fill,
            programs,
            seq_lens.stride(0),
            BLOCK_N=block_n,
            BLOCK_R=plan_rows_block(num_seqs),
            MIN_SPLIT=triton.cdiv(MIN_SPLIT_TOKENS, block_n) * block_n,
            num_warps=4,
        )
    return DecodePlan(items, split_counts, arrivals, num_seqs, num_splits, programs)


def planned_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int,
    out: torch.Tensor | None = None,
    *,
    plan: DecodePlan | None = None,
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
    num_splits: the most splits one sequence's context may be cut into, from planned_num_splits; any
        value >= 1 is correct (1: no merge pass). Each sequence gets as many as its share of the step's
        tokens asks for (plan_decode, from the lengths on the device).
    out: [num_seqs, num_heads, head_dim], query's dtype, written in place if given.
    plan: the step's work items from plan_decode, for these seq_lens and num_splits (a model's layers
        share one); made here without one.

    CUDA-graph safe: the grids are fixed by the shapes and the device, and the plan is computed on the
    device from the loaded seq_lens; no host-device synchronisation. check=False skips the argument
    checks (~20 us of host time a call), for callers whose tensors are their own.
    """
    block_n, num_warps, num_stages = decode_tile(query.shape[-1] if query.dim() else 0, query.dtype)
    return _planned_decode_attention(
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
        plan=plan,
        check=check,
    )


def _planned_decode_attention(
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
    fill: int | None = None,
    plan: DecodePlan | None = None,
    check: bool = True,
) -> torch.Tensor:
    """planned_decode_attention with the tile configuration spelled out (the tests' interpreter tiles).
    fill: plan_decode's, for the plan made here when none is given (a given plan has its own)."""
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

    if plan is None:
        plan = plan_decode(query, seq_lens, num_splits, num_kv_heads, fill=fill, block_n=block_n)
    elif (plan.num_seqs, plan.num_splits, plan.arrivals.numel()) != (
        num_seqs,
        num_splits,
        num_seqs * num_kv_heads,
    ):
        raise ValueError(
            f"plan is for {plan.num_seqs} rows, {plan.num_splits} splits and "
            f"{plan.arrivals.numel() // max(plan.num_seqs, 1)} KV heads, the call has {num_seqs}, "
            f"{num_splits} and {num_kv_heads}"
        )
    programs = plan.programs
    direct = num_splits == 1
    if direct:
        # Never read: any float32 tensor stands in for the scratch pointers, with the strides the
        # scratch would have (a stride of 0 would specialise the kernel into a variant of its own).
        partial_out = partial_lse = out.new_empty(0, dtype=torch.float32)
        po_strides: tuple[int, ...] = (num_heads * head_dim, head_dim)
        lse_stride = num_heads
    else:
        # Scratch per call, an item a program (torch.empty is allowed under graph capture: the graph's
        # pool owns it).
        partial_out = torch.empty((programs, num_heads, head_dim), dtype=torch.float32, device=query.device)
        partial_lse = torch.empty((programs, num_heads), dtype=torch.float32, device=query.device)
        po_strides = partial_out.stride()[:2]
        lse_stride = partial_lse.stride(0)

    log2e = 1.4426950408889634
    _decode_split_kernel[(programs, num_kv_heads)](
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        plan.items,
        plan.split_counts,
        plan.arrivals,
        partial_out,
        partial_lse,
        out,
        float(scale) * log2e,
        num_seqs,
        num_kv_heads,
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
        lse_stride,
        out.stride(0),
        out.stride(1),
        GROUP_SIZE=group_size,
        BLOCK_G=max(16, triton.next_power_of_2(group_size)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_N=block_n,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out

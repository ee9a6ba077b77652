"""Neox-style rotary embedding applied in place to query and key: one Triton program per token.

The attention layer (engine/models/llama.py) calls `apply_rotary` on its q and k views of the qkv
projection, with the float32 cos/sin table of its RotaryEmbedding. The kernel rotates in float32 and
rounds once; `apply_rotary_reference` is the model's torch code (which rounds cos/sin and every op).
`rotary_store_kv` fuses that rotation with the paged K/V store of engine/kernels/kv_cache.py (one
launch a layer instead of two); the Triton attention backend calls it when the model hands it the rotation.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engine.kernels.checks import check_kv_store, check_rotary

# Elements of one half-head tile a loop step rotates: [BLOCK_HEADS, BLOCK_HALF] <= this.
MAX_TILE = 2048


@triton.jit
def _rotate_tile(
    first_ptrs,  # [BLOCK_HEADS, BLOCK_HALF]: the first half of each head; the second half is HALF further
    mask,  # [BLOCK_HEADS, BLOCK_HALF]
    cos,  # [BLOCK_HALF] float32
    sin,  # [BLOCK_HALF] float32
    HALF: tl.constexpr,
):
    """Both rotated halves of a tile of heads, rounded once to the tensor's dtype. The one place the
    rotation's arithmetic lives, so the plain and the fused kernels agree bit for bit."""
    x1 = tl.load(first_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    out1 = x1 * cos[None, :] - x2 * sin[None, :]
    out2 = x2 * cos[None, :] + x1 * sin[None, :]
    dtype = first_ptrs.dtype.element_ty
    return out1.to(dtype), out2.to(dtype)


@triton.jit
def _rotate_heads(
    base_ptr,  # this token's first head: [num_heads, head_dim] with head stride head_stride
    head_stride,
    NUM_HEADS: tl.constexpr,
    cos,  # [BLOCK_HALF] float32
    sin,  # [BLOCK_HALF] float32
    half_offsets,  # [BLOCK_HALF]
    half_mask,  # [BLOCK_HALF]
    HALF: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
):
    # Static bounds (head counts are constexpr): a short loop, usually one step, known at compile time.
    for first_head in range(0, NUM_HEADS, BLOCK_HEADS):
        heads = first_head + tl.arange(0, BLOCK_HEADS)
        mask = (heads[:, None] < NUM_HEADS) & half_mask[None, :]
        # [BLOCK_HEADS, BLOCK_HALF]: the first half of each head; the second half is HALF further.
        first_ptrs = base_ptr + heads[:, None] * head_stride + half_offsets[None, :]
        out1, out2 = _rotate_tile(first_ptrs, mask, cos, sin, HALF)
        tl.store(first_ptrs, out1, mask=mask)
        tl.store(first_ptrs + HALF, out2, mask=mask)


@triton.jit
def _rotary_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [max_positions, head_dim] float32: cos of each frequency, then sin
    positions_ptr,  # [num_tokens] int64 or int32
    query_row_stride,
    query_head_stride,
    key_row_stride,
    key_head_stride,
    cos_sin_row_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QUERY_HEADS: tl.constexpr,
    BLOCK_KEY_HEADS: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    half_offsets = tl.arange(0, BLOCK_HALF)
    half_mask = half_offsets < HALF
    # cos/sin loaded once per token and shared by all query and key heads.
    cos_ptrs = cos_sin_ptr + position * cos_sin_row_stride + half_offsets
    cos = tl.load(cos_ptrs, mask=half_mask, other=0.0)
    sin = tl.load(cos_ptrs + HALF, mask=half_mask, other=0.0)
    _rotate_heads(
        query_ptr + token * query_row_stride,
        query_head_stride,
        NUM_HEADS,
        cos,
        sin,
        half_offsets,
        half_mask,
        HALF,
        BLOCK_QUERY_HEADS,
    )
    _rotate_heads(
        key_ptr + token * key_row_stride,
        key_head_stride,
        NUM_KV_HEADS,
        cos,
        sin,
        half_offsets,
        half_mask,
        HALF,
        BLOCK_KEY_HEADS,
    )


@triton.jit
def _rotary_store_kv_kernel(
    query_ptr,  # [num_tokens, num_heads, head_dim]
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_ptr,  # [max_positions, head_dim] float32: cos of each frequency, then sin
    positions_ptr,  # [num_tokens] int64 or int32
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens]: block * block_size + offset, < 0 for padding rows
    query_row_stride,
    query_head_stride,
    key_row_stride,
    key_head_stride,
    value_row_stride,
    value_head_stride,
    cos_sin_row_stride,
    key_cache_block_stride,
    key_cache_slot_stride,
    key_cache_head_stride,
    value_cache_block_stride,
    value_cache_slot_stride,
    value_cache_head_stride,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_QUERY_HEADS: tl.constexpr,
    BLOCK_KEY_HEADS: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    half_offsets = tl.arange(0, BLOCK_HALF)
    half_mask = half_offsets < HALF
    cos_ptrs = cos_sin_ptr + position * cos_sin_row_stride + half_offsets
    cos = tl.load(cos_ptrs, mask=half_mask, other=0.0)
    sin = tl.load(cos_ptrs + HALF, mask=half_mask, other=0.0)
    _rotate_heads(
        query_ptr + token * query_row_stride,
        query_head_stride,
        NUM_HEADS,
        cos,
        sin,
        half_offsets,
        half_mask,
        HALF,
        BLOCK_QUERY_HEADS,
    )
    key_row = key_ptr + token * key_row_stride
    value_row = value_ptr + token * value_row_stride
    key_slot = key_cache_ptr + block * key_cache_block_stride + offset * key_cache_slot_stride
    value_slot = value_cache_ptr + block * value_cache_block_stride + offset * value_cache_slot_stride
    # Padding rows (slot < 0) are rotated like any row (as apply_rotary does) but store nothing in the
    # cache. The slot test is broadcast to a tensor first (the interpreter mishandles scalar & tensor).
    slot_valid = (slot + tl.zeros([BLOCK_KEY_HEADS], tl.int64)) >= 0  # [BLOCK_KEY_HEADS]
    for first_head in range(0, NUM_KV_HEADS, BLOCK_KEY_HEADS):
        heads = first_head + tl.arange(0, BLOCK_KEY_HEADS)
        mask = (heads[:, None] < NUM_KV_HEADS) & half_mask[None, :]  # [BLOCK_KEY_HEADS, BLOCK_HALF]
        cache_mask = mask & slot_valid[:, None]
        # The rotated key stays in registers: written back in place and into the cache from there.
        key_ptrs = key_row + heads[:, None] * key_head_stride + half_offsets[None, :]
        out1, out2 = _rotate_tile(key_ptrs, mask, cos, sin, HALF)
        tl.store(key_ptrs, out1, mask=mask)
        tl.store(key_ptrs + HALF, out2, mask=mask)
        key_cache_ptrs = key_slot + heads[:, None] * key_cache_head_stride + half_offsets[None, :]
        tl.store(key_cache_ptrs, out1, mask=cache_mask)
        tl.store(key_cache_ptrs + HALF, out2, mask=cache_mask)
        # The value is copied as is, in the same two halves.
        value_ptrs = value_row + heads[:, None] * value_head_stride + half_offsets[None, :]
        value1 = tl.load(value_ptrs, mask=cache_mask)
        value2 = tl.load(value_ptrs + HALF, mask=cache_mask)
        value_cache_ptrs = value_slot + heads[:, None] * value_cache_head_stride + half_offsets[None, :]
        tl.store(value_cache_ptrs, value1, mask=cache_mask)
        tl.store(value_cache_ptrs + HALF, value2, mask=cache_mask)


@functools.cache
def _tile_sizes(head_dim: int, num_heads: int, num_kv_heads: int) -> dict[str, int]:
    """The rotary kernels' constexpr tile sizes: half-heads padded to a power of two, and as many
    heads a loop step as fit in MAX_TILE elements (one step for the models we serve). Cached: called
    on every launch, a layer at a time (callers unpack it, never change it)."""
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = max(MAX_TILE // block_half, 1)
    return {
        "HALF": half,
        "BLOCK_HALF": block_half,
        "BLOCK_QUERY_HEADS": min(triton.next_power_of_2(max(num_heads, 1)), max_heads),
        "BLOCK_KEY_HEADS": min(triton.next_power_of_2(max(num_kv_heads, 1)), max_heads),
    }


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """Rotate query and key in place by their tokens' positions (neox style: halves of each head).

    query: [num_tokens, num_heads, head_dim]; key: [num_tokens, num_kv_heads, head_dim]; same dtype
    (bf16/fp16/fp32), last dim contiguous, any token and head strides (views into one qkv tensor are
    fine; query and key must not overlap). cos_sin: [max_positions, head_dim] float32, cos of each frequency then sin.
    positions: [num_tokens] int64 (or int32), each in [0, max_positions): not checked, as that would
    sync with the device. out_first = x1*cos - x2*sin, out_second = x2*cos + x1*sin, in float32.
    """
    check_rotary(query, key, cos_sin, positions)
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        cos_sin,
        positions,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        cos_sin.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=key.shape[1],
        **_tile_sizes(head_dim, num_heads, key.shape[1]),
        num_warps=4,
    )


def rotary_store_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cos_sin: torch.Tensor,
    positions: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """apply_rotary(query, key, cos_sin, positions) then store_kv(key, value, key_cache, value_cache,
    slot_mapping), in one launch and bit for bit the same: one launch a layer fewer on the decode path.

    query: [num_tokens, num_heads, head_dim], rotated in place.
    key: [num_tokens, num_kv_heads, head_dim], rotated in place (the caller's key stays rotated) and
        stored into key_cache at each token's slot.
    value: [num_tokens, num_kv_heads, head_dim], stored into value_cache as is.
    cos_sin: [max_positions, head_dim] float32; positions: [num_tokens] int64 or int32, each in
        [0, max_positions) (not checked: that would sync with the device), padding rows included.
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] of key's dtype (views such
        as kv_cache[0] are fine); slot_mapping: [num_tokens] int64 or int32, < 0 for a padding row,
        which is rotated but leaves the cache untouched.
    Views of one qkv output are fine (last dims contiguous; query, key, value must not overlap). No
    host-device synchronisation: safe under CUDA-graph capture. check=False skips the argument checks
    (tens of microseconds of host time), for callers whose tensors are their own.
    """
    if check:
        check_rotary(query, key, cos_sin, positions)
        check_kv_store(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if num_tokens == 0:
        return
    _rotary_store_kv_kernel[(num_tokens,)](
        query,
        key,
        value,
        cos_sin,
        positions,
        key_cache,
        value_cache,
        slot_mapping,
        query.stride(0),
        query.stride(1),
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        cos_sin.stride(0),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        **_tile_sizes(head_dim, num_heads, num_kv_heads),
        BLOCK_SIZE=key_cache.shape[1],
        num_warps=4,
    )

"""Neox-style rotary embedding applied in place to query and key: one Triton program per token.

The attention layer (engine/models/llama.py) calls `apply_rotary` on its q and k views of the qkv
projection, with the float32 cos/sin table of its RotaryEmbedding. The kernel rotates in float32 and
rounds once; `apply_rotary_reference` is the model's torch code (which rounds cos/sin and every op).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import check_rotary

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
    """Both rotated halves of a tile of heads, rounded once to the tensor's dtype: the one place the
    rotation's arithmetic lives, for every kernel that rotates."""
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


def _tile_sizes(head_dim: int, num_heads: int, num_kv_heads: int) -> dict[str, int]:
    """The rotary kernels' constexpr tile sizes: half-heads padded to a power of two, and as many
    heads a loop step as fit in MAX_TILE elements (one step for the models we serve)."""
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

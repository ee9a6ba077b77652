"""Store this step's K/V into the paged cache: one launch writes both, one program per token.

The Triton attention backend calls `store_kv` before attention, with the runner's slot mapping. Padding
rows (CUDA-graph batches padded to a captured size) carry a negative slot and are skipped, so the
dummy tokens never touch the cache.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.checks import check_kv_store


@triton.jit
def _store_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    key_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache_ptr,
    slot_mapping_ptr,  # [num_tokens]: block * block_size + offset, < 0 for padding rows
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,  # NUM_KV_HEADS padded to a power of two
    BLOCK_D: tl.constexpr,  # HEAD_DIM padded to a power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    # Padding rows (slot < 0) load and store nothing: the mask is false everywhere. The slot test is
    # broadcast to a tensor first (the interpreter mishandles a scalar & tensor mask).
    head_valid = (offs_h < NUM_KV_HEADS) & ((slot + tl.zeros([BLOCK_H], tl.int64)) >= 0)  # [BLOCK_H]
    mask = head_valid[:, None] & (offs_d[None, :] < HEAD_DIM)  # [BLOCK_H, BLOCK_D]

    key = tl.load(
        key_ptr + token * stride_key_token + offs_h[:, None] * stride_key_head + offs_d[None, :], mask=mask
    )
    key_dst = key_cache_ptr + block * stride_kc_block + offset * stride_kc_slot
    tl.store(key_dst + offs_h[:, None] * stride_kc_head + offs_d[None, :], key, mask=mask)

    value = tl.load(
        value_ptr + token * stride_value_token + offs_h[:, None] * stride_value_head + offs_d[None, :],
        mask=mask,
    )
    value_dst = value_cache_ptr + block * stride_vc_block + offset * stride_vc_slot
    tl.store(value_dst + offs_h[:, None] * stride_vc_head + offs_d[None, :], value, mask=mask)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    check: bool = True,
) -> None:
    """Write key[i], value[i] into slot slot_mapping[i] of key_cache, value_cache (skipped where < 0).

    key, value: [num_tokens, num_kv_heads, head_dim], last dim contiguous (strided views of a qkv output
        are fine).
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype as key, last dim
        contiguous; may be strided views (kv_cache[0], kv_cache[1]).
    slot_mapping: [num_tokens] int64 (or int32): block * block_size + offset in the block.

    One launch, no host-device synchronisation: safe under CUDA-graph capture. check=False skips the
    argument checks (tens of microseconds of host time), for callers whose tensors are their own.
    """
    if check:
        check_kv_store(key, value, key_cache, value_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = key.shape
    block_size = key_cache.shape[1]
    if num_tokens == 0:
        return

    block_h = triton.next_power_of_2(num_kv_heads)
    block_d = triton.next_power_of_2(head_dim)
    # A token moves num_kv_heads * head_dim elements each way: one warp per 256 of them, 1..4 warps.
    num_warps = max(1, min(4, block_h * block_d // 256))
    _store_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        BLOCK_SIZE=block_size,
        num_warps=num_warps,
    )

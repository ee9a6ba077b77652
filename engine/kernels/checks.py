"""Argument checks the attention, KV-cache and rotary launchers share: the query and the paged cache,
the index tensors, an `out` buffer, the rotary inputs, a K/V store (the fused rotary + store launcher
runs the last two). Each raises ValueError naming the first thing wrong, and formats its
message only then (checks run in every layer of every eager step). Launchers skip them with
check=False where the caller built the tensors itself."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)
HEAD_DIMS = (16, 32, 64, 128, 256)  # powers of two: the kernels tile head_dim whole


def check_paged_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, like: torch.Tensor) -> None:
    """key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim] of like's dtype and
    device, last dim contiguous (strided views such as kv_cache[0] are fine), block_size a power of two."""
    if key_cache.dim() != 4:
        raise ValueError(
            "key_cache must be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(key_cache.shape)}"
        )
    if value_cache.shape != key_cache.shape:
        raise ValueError(
            f"value_cache shape {tuple(value_cache.shape)} differs from key_cache {tuple(key_cache.shape)}"
        )
    if key_cache.dtype != like.dtype or value_cache.dtype != like.dtype:
        raise ValueError(
            f"key_cache/value_cache dtype ({key_cache.dtype}/{value_cache.dtype}) must equal {like.dtype}"
        )
    block_size = key_cache.shape[1]
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    for name, tensor in (("key_cache", key_cache), ("value_cache", value_cache)):
        check_last_dim_contiguous(name, tensor)
        check_device(name, tensor, like)


def check_query_against_cache(
    query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
) -> None:
    """query [tokens or sequences, num_heads, head_dim] and a paged cache it can attend to (GQA)."""
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, num_heads, head_dim], got shape {tuple(query.shape)}")
    if query.dtype not in FLOAT_DTYPES:
        raise ValueError(f"query dtype must be one of {FLOAT_DTYPES}, got {query.dtype}")
    check_last_dim_contiguous("query", query)
    check_paged_cache(key_cache, value_cache, query)
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads, cache_head_dim = key_cache.shape[2], key_cache.shape[3]
    if cache_head_dim != head_dim:
        raise ValueError(f"cache head_dim {cache_head_dim} differs from query head_dim {head_dim}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")


def check_index(name: str, tensor: torch.Tensor, dims: int, min_rows: int, like: torch.Tensor) -> None:
    """An int32/int64 index tensor of `dims` dimensions with at least min_rows rows, on like's device."""
    if tensor.dim() != dims or tensor.shape[0] < min_rows:
        raise ValueError(f"{name} must be [>= {min_rows}{', ...' * (dims - 1)}], got {tuple(tensor.shape)}")
    if tensor.dtype not in INDEX_DTYPES:
        raise ValueError(f"{name} dtype must be int32 or int64, got {tensor.dtype}")
    check_last_dim_contiguous(name, tensor)
    check_device(name, tensor, like)


def check_out(out: torch.Tensor | None, query: torch.Tensor) -> None:
    """An output buffer must match query's shape, dtype and device, last dim contiguous."""
    if out is None:
        return
    if out.shape != query.shape or out.dtype != query.dtype or out.device != query.device:
        raise ValueError(
            f"out must match query ({tuple(query.shape)}, {query.dtype}, {query.device}), "
            f"got ({tuple(out.shape)}, {out.dtype}, {out.device})"
        )
    check_last_dim_contiguous("out", out)


def check_rotary(
    query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> None:
    """query [num_tokens, num_heads, head_dim] and key [num_tokens, num_kv_heads, head_dim] of one float
    dtype, head_dim even (neox rotates halves); cos_sin [max_positions, head_dim] float32; positions
    [num_tokens] int64 or int32; all on query's device, last dims contiguous. Positions are not checked
    against max_positions: that would sync with the device."""
    for name, heads in (("query", query), ("key", key)):
        if heads.dim() != 3:
            raise ValueError(f"{name} must be [num_tokens, heads, head_dim], got shape {tuple(heads.shape)}")
        if heads.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{name} has dtype {heads.dtype}; supported: {FLOAT_DTYPES}")
        check_last_dim_contiguous(name, heads)
    num_tokens, _, head_dim = query.shape
    if key.dtype != query.dtype:
        raise ValueError(f"key has dtype {key.dtype}, query {query.dtype}")
    if key.shape[0] != num_tokens or key.shape[2] != head_dim:
        raise ValueError(
            f"key has shape {tuple(key.shape)}, query {tuple(query.shape)}: tokens and head_dim must match"
        )
    if head_dim % 2 != 0:
        raise ValueError(f"head_dim must be even, got {head_dim}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"cos_sin has shape {tuple(cos_sin.shape)}, expected [max_positions, {head_dim}]")
    if cos_sin.dtype != torch.float32:
        raise ValueError(f"cos_sin has dtype {cos_sin.dtype}, expected torch.float32")
    check_last_dim_contiguous("cos_sin", cos_sin)
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions has shape {tuple(positions.shape)}, expected ({num_tokens},)")
    if positions.dtype not in INDEX_DTYPES:
        raise ValueError(f"positions has dtype {positions.dtype}, expected torch.int64 or torch.int32")
    for name, tensor in (("key", key), ("cos_sin", cos_sin), ("positions", positions)):
        check_device(name, tensor, query)


def check_kv_store(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """key, value [num_tokens, num_kv_heads, head_dim] alike, last dim contiguous; a paged cache of
    their dtype and [num_kv_heads, head_dim]; slot_mapping [num_tokens] int32/int64."""
    if key.dim() != 3:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_dim], got shape {tuple(key.shape)}")
    if value.shape != key.shape:
        raise ValueError(f"value shape {tuple(value.shape)} differs from key {tuple(key.shape)}")
    if value.dtype != key.dtype:
        raise ValueError(f"value dtype {value.dtype} differs from key's {key.dtype}")
    for name, tensor in (("key", key), ("value", value)):
        check_last_dim_contiguous(name, tensor)
        check_device(name, tensor, key)
    check_paged_cache(key_cache, value_cache, key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if tuple(key_cache.shape[2:]) != (num_kv_heads, head_dim):
        raise ValueError(
            f"cache [num_kv_heads, head_dim] = {tuple(key_cache.shape[2:])} differs from key's "
            f"{(num_kv_heads, head_dim)}"
        )
    if slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be [num_tokens ({num_tokens})], got {tuple(slot_mapping.shape)}")
    check_index("slot_mapping", slot_mapping, 1, num_tokens, key)


def check_last_dim_contiguous(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() and tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, strides {tensor.stride()}")


def check_device(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    if tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device}, expected {like.device}")

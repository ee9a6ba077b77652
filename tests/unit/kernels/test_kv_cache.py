"""store_kv against index_copy_ into the flattened cache: random slots, padding rows (-1) skipped, strided
key/value views of a fused qkv output, and caches that are views of one [2, num_blocks, ...] tensor.
The copy is exact, so the comparison is exact in every dtype."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.kv_cache import store_kv


def reference_store(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens]
) -> torch.Tensor:
    expected = kv_cache.clone()
    flat = expected.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim]
    keep = slot_mapping >= 0
    flat[0].index_copy_(0, slot_mapping[keep].long(), key[keep])
    flat[1].index_copy_(0, slot_mapping[keep].long(), value[keep])
    return expected


def make_case(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    num_blocks: int,
    dtype: torch.dtype,
    slot_dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(key, value, kv_cache, slot_mapping): key/value are strided views into a fused qkv buffer
    [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim]; distinct random slots, every third one -1."""
    generator = torch.Generator().manual_seed(seed)
    num_heads = 3 * num_kv_heads
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=generator)
    qkv = qkv.to(device=device, dtype=dtype)
    kv_width = num_kv_heads * head_dim
    key = qkv[:, num_heads * head_dim : num_heads * head_dim + kv_width].view(
        num_tokens, num_kv_heads, head_dim
    )
    value = qkv[:, num_heads * head_dim + kv_width :].view(num_tokens, num_kv_heads, head_dim)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=generator)
    slots = torch.randperm(num_blocks * block_size, generator=generator)[:num_tokens]
    slots[::3] = -1
    return key, value, kv_cache.to(device=device, dtype=dtype), slots.to(device=device, dtype=slot_dtype)


@pytest.mark.parametrize(
    "dtype,slot_dtype,num_kv_heads,head_dim,block_size",
    [
        (torch.float32, torch.int64, 2, 32, 4),
        (torch.float16, torch.int32, 3, 16, 16),  # heads not a power of two: masked
        (torch.float32, torch.int64, 1, 24, 8),  # head_dim not a power of two: masked
    ],
)
def test_store_kv_matches_index_copy(dtype, slot_dtype, num_kv_heads, head_dim, block_size, device):
    key, value, kv_cache, slots = make_case(
        11, num_kv_heads, head_dim, block_size, 6, dtype, slot_dtype, device
    )
    assert not key.is_contiguous()
    expected = reference_store(key, value, kv_cache, slots)
    store_kv(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, expected)


def test_padding_rows_leave_the_cache_untouched(device):
    key, value, kv_cache, slots = make_case(5, 2, 16, 4, 3, torch.float32, torch.int64, device)
    slots.fill_(-1)
    before = kv_cache.clone()
    store_kv(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, before)


def test_zero_tokens_is_a_no_op(device):
    key, value, kv_cache, slots = make_case(0, 2, 16, 4, 3, torch.float32, torch.int64, device)
    store_kv(key, value, kv_cache[0], kv_cache[1], slots)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "key": a["key"][0]}, "key must be"),
        (lambda a: {**a, "value": a["value"][:-1]}, "value shape"),
        (
            lambda a: {**a, "key_cache": a["key_cache"][..., :8], "value_cache": a["value_cache"][..., :8]},
            "differs",
        ),
        (
            lambda a: {**a, "key_cache": a["key_cache"].half(), "value_cache": a["value_cache"].half()},
            "dtype",
        ),
        (lambda a: {**a, "slot_mapping": a["slot_mapping"][:-1]}, "slot_mapping must be"),
        (lambda a: {**a, "slot_mapping": a["slot_mapping"].float()}, "slot_mapping dtype"),
        (lambda a: {**a, "key": a["key"].transpose(1, 2).contiguous().transpose(1, 2)}, "contiguous last"),
    ],
)
def test_store_kv_rejects_bad_inputs(change, message, device):
    key, value, kv_cache, slots = make_case(4, 2, 16, 4, 3, torch.float32, torch.int64, device)
    arguments = {
        "key": key,
        "value": value,
        "key_cache": kv_cache[0],
        "value_cache": kv_cache[1],
        "slot_mapping": slots,
    }
    with pytest.raises(ValueError, match=message):
        store_kv(**change(arguments))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 7, 256, 8192])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_store_kv(num_tokens, dtype):
    device = torch.device("cuda")
    key, value, kv_cache, slots = make_case(num_tokens, 2, 128, 16, 1024, dtype, torch.int64, device)
    expected = reference_store(key, value, kv_cache, slots)
    store_kv(key, value, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, expected)

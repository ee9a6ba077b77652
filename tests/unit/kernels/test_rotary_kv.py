"""rotary_store_kv against the two launches it replaces, apply_rotary then store_kv: bit for bit on the
query, the key, the value and the whole cache (the same float32 rotation, rounded once, then an exact
copy), and against the torch references (tolerances of tests/unit/kernels/test_rotary.py for the
rotation, exact for the store). Slots come from block tables, so a sequence's tokens cross block
boundaries; padding rows (slot -1) are rotated but leave the cache untouched.
"""

from __future__ import annotations

import pytest
import torch
from test_kv_cache import reference_store
from test_rotary import assert_rotated, make_cos_sin, make_qkv

from engine.kernels.kv_cache import store_kv
from engine.kernels.reference import apply_rotary_reference
from engine.kernels.rotary import apply_rotary, rotary_store_kv

MAX_POSITIONS = 64


def make_step(
    sequence_lengths: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype,
    device: torch.device,
    padding_rows: int = 0,
    seed: int = 0,
):
    """One step's tensors: q, k, v views of a qkv output, the cos/sin table, positions and slots, and a
    random [2, num_blocks, block_size, num_kv_heads, head_dim] cache.

    Sequence i contributes its last sequence_lengths[i] tokens at positions starting at a random
    offset, with its own shuffled block table, so consecutive tokens cross block boundaries; then
    padding_rows rows at position 0 and slot -1, as a padded CUDA-graph batch carries.
    """
    generator = torch.Generator().manual_seed(seed)
    positions, slots = [], []
    num_blocks = sum(-(-MAX_POSITIONS // block_size) for _ in sequence_lengths)
    free_blocks = torch.randperm(num_blocks, generator=generator).tolist()
    for length in sequence_lengths:
        start = int(torch.randint(0, MAX_POSITIONS - length + 1, (1,), generator=generator))
        table = [free_blocks.pop() for _ in range(-(-MAX_POSITIONS // block_size))]
        for position in range(start, start + length):
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
    positions += [0] * padding_rows
    slots += [-1] * padding_rows
    num_tokens = len(positions)
    qkv, query, key, value = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device, seed)
    cache_shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(cache_shape, generator=generator).to(device=device, dtype=dtype)
    return (
        qkv,
        (query, key, value),
        make_cos_sin(MAX_POSITIONS, head_dim, 10000.0, device),
        torch.tensor(positions, dtype=index_dtype, device=device),
        torch.tensor(slots, dtype=index_dtype, device=device),
        kv_cache,
    )


def views(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int):
    """q, k, v views of another qkv buffer of the same layout (a clone of the step's)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    num_tokens = qkv.shape[0]
    return (
        query.view(num_tokens, num_heads, head_dim),
        key.view(num_tokens, num_kv_heads, head_dim),
        value.view(num_tokens, num_kv_heads, head_dim),
    )


CASES = [  # (sequence_lengths, num_heads, num_kv_heads, head_dim, block_size, padding_rows)
    ([1, 1, 1], 12, 2, 16, 4, 1),  # decodes of a GQA model (Qwen2.5's 12/2 heads), one padding row
    ([9, 1], 12, 2, 32, 4, 0),  # a 9-token chunk over 3-4 blocks of 4
    ([5, 3], 4, 4, 12, 2, 2),  # a half of 6: no power of two, masked
    ([2], 40, 34, 128, 8, 1),  # 40 q heads and 34 kv heads of 128: two loop steps each, the second masked
]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lengths,num_heads,num_kv_heads,head_dim,block_size,padding_rows", CASES)
def test_matches_apply_rotary_then_store_kv_bit_for_bit(
    device, dtype, index_dtype, lengths, num_heads, num_kv_heads, head_dim, block_size, padding_rows
):
    qkv, (query, key, value), cos_sin, positions, slots, kv_cache = make_step(
        lengths, num_heads, num_kv_heads, head_dim, block_size, dtype, index_dtype, device, padding_rows
    )
    qkv_before, kv_cache_before = qkv.clone(), kv_cache.clone()
    two_launches_qkv, two_launches_cache = qkv.clone(), kv_cache.clone()
    two_query, two_key, two_value = views(two_launches_qkv, num_heads, num_kv_heads, head_dim)
    apply_rotary(two_query, two_key, cos_sin, positions)
    store_kv(two_key, two_value, two_launches_cache[0], two_launches_cache[1], slots)

    rotary_store_kv(query, key, value, cos_sin, positions, kv_cache[0], kv_cache[1], slots)

    assert torch.equal(qkv, two_launches_qkv)  # q and k rotated alike, v and nothing else touched
    assert torch.equal(kv_cache, two_launches_cache)
    # And against the torch references: the model's rotary, then index_copy_ of the rotated key.
    before_query, before_key, before_value = views(qkv_before, num_heads, num_kv_heads, head_dim)
    long_positions = positions.long()
    expected_query, expected_key = apply_rotary_reference(before_query, before_key, cos_sin, long_positions)
    assert_rotated(query, before_query, cos_sin, long_positions, expected_query)
    assert_rotated(key, before_key, cos_sin, long_positions, expected_key)
    assert torch.equal(value, before_value)
    assert torch.equal(kv_cache, reference_store(key, value, kv_cache_before, slots))


def test_padding_rows_are_rotated_but_leave_the_cache_untouched(device):
    qkv, (query, key, value), cos_sin, positions, slots, kv_cache = make_step(
        [3], 4, 2, 16, 4, torch.float32, torch.int64, device
    )
    positions.copy_(torch.tensor([5, 6, 7], device=device))
    slots.fill_(-1)
    cache_before, qkv_before = kv_cache.clone(), qkv.clone()
    rotary_store_kv(query, key, value, cos_sin, positions, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, cache_before)
    before_query, before_key, before_value = views(qkv_before, 4, 2, 16)
    expected_query, expected_key = apply_rotary_reference(before_query, before_key, cos_sin, positions)
    assert_rotated(query, before_query, cos_sin, positions, expected_query)
    assert_rotated(key, before_key, cos_sin, positions, expected_key)
    assert torch.equal(value, before_value)


def test_zero_tokens_is_a_no_op(device):
    _, (query, key, value), cos_sin, positions, slots, kv_cache = make_step(
        [], 4, 2, 16, 4, torch.float32, torch.int64, device
    )
    cache_before = kv_cache.clone()
    rotary_store_kv(query, key, value, cos_sin, positions, kv_cache[0], kv_cache[1], slots)
    assert torch.equal(kv_cache, cache_before)


BAD_ARGUMENTS = [  # (what the message names, change to the arguments of a good call)
    ("query must be", lambda a: {**a, "query": a["query"][0]}),
    ("key has dtype", lambda a: {**a, "key": a["key"].half()}),
    ("head_dim must be even", lambda a: {**a, **{n: a[n][..., :7] for n in ("query", "key", "value")}}),
    ("cos_sin has dtype", lambda a: {**a, "cos_sin": a["cos_sin"].double()}),
    ("positions has dtype", lambda a: {**a, "positions": a["positions"].float()}),
    ("positions has shape", lambda a: {**a, "positions": a["positions"][:1]}),
    ("value shape", lambda a: {**a, "value": a["value"][:, :1]}),
    (
        "block_size must be a power of two",
        lambda a: {**a, **{n: a[n][:, :3] for n in ("key_cache", "value_cache")}},
    ),
    ("differs from key's", lambda a: {**a, **{n: a[n][..., :8] for n in ("key_cache", "value_cache")}}),
    ("slot_mapping must be", lambda a: {**a, "slot_mapping": a["slot_mapping"][:-1]}),
    ("slot_mapping dtype", lambda a: {**a, "slot_mapping": a["slot_mapping"].float()}),
]


@pytest.mark.parametrize("message,change", BAD_ARGUMENTS, ids=[message for message, _ in BAD_ARGUMENTS])
def test_bad_arguments_raise_value_error_naming_the_problem(device, message, change):
    _, (query, key, value), cos_sin, positions, slots, kv_cache = make_step(
        [2], 4, 2, 16, 4, torch.float32, torch.int64, device
    )
    arguments = {
        "query": query,
        "key": key,
        "value": value,
        "cos_sin": cos_sin,
        "positions": positions,
        "key_cache": kv_cache[0],
        "value_cache": kv_cache[1],
        "slot_mapping": slots,
    }
    with pytest.raises(ValueError, match=message):
        rotary_store_kv(**change(arguments))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("num_decodes", [1, 64, 256])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(12, 2, 128), (32, 4, 64)])
def test_gpu_bf16_matches_the_two_launches(num_decodes, num_heads, num_kv_heads, head_dim):
    device = torch.device("cuda")
    qkv, (query, key, value), cos_sin, positions, slots, kv_cache = make_step(
        [1] * num_decodes, num_heads, num_kv_heads, head_dim, 16, torch.bfloat16, torch.int32, device, 3
    )
    two_launches_qkv, two_launches_cache = qkv.clone(), kv_cache.clone()
    two_query, two_key, two_value = views(two_launches_qkv, num_heads, num_kv_heads, head_dim)
    apply_rotary(two_query, two_key, cos_sin, positions)
    store_kv(two_key, two_value, two_launches_cache[0], two_launches_cache[1], slots)
    rotary_store_kv(query, key, value, cos_sin, positions, kv_cache[0], kv_cache[1], slots, check=False)
    assert torch.equal(qkv, two_launches_qkv)
    assert torch.equal(kv_cache, two_launches_cache)

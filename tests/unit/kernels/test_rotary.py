"""Neox rotary in place against the torch reference of engine/models/llama.py, and against float64.

Tolerances, in ulp of the pair's magnitude m = max(|x1|, |x2|) of the two elements rotated together:
the kernel rotates in float32 and rounds once (within 1 ulp(m) of the float64 rotation); the reference
rounds cos/sin to the dtype and rounds after each op, so the two agree within 2 ulp(m) (fp16/bf16; at
most 2.0 over 4e8 bf16 samples, about 0.7% of elements differ by more than 1). A tolerance relative to
the output itself would not hold where x1*cos - x2*sin cancels. float32: 1e-5 absolute for unit inputs.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels.reference import apply_rotary_reference
from engine.kernels.rotary import apply_rotary

ON_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
MANTISSA_BITS = {torch.float16: 10, torch.bfloat16: 7}


def make_cos_sin(max_positions: int, head_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """[max_positions, head_dim] float32 as RotaryEmbedding.init_cache builds it (no scaling)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)


def make_qkv(num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device, seed: int = 0):
    """qkv [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim] and its q, k, v views."""
    generator = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=generator).to(dtype).to(device)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    query, key, value = qkv.split([q_size, kv_size, kv_size], dim=-1)
    return (
        qkv,
        query.view(num_tokens, num_heads, head_dim),
        key.view(num_tokens, num_kv_heads, head_dim),
        value.view(num_tokens, num_kv_heads, head_dim),
    )


def pair_ulp(x: torch.Tensor) -> torch.Tensor:
    """[..., head_dim] float32: ulp in x's dtype of max(|x1|, |x2|), for both elements of each pair."""
    half = x.shape[-1] // 2
    magnitude = torch.maximum(x[..., :half].abs(), x[..., half:].abs()).float()
    magnitude = torch.cat([magnitude, magnitude], dim=-1).clamp_min(torch.finfo(x.dtype).tiny)
    return torch.exp2(torch.floor(torch.log2(magnitude)) - MANTISSA_BITS[x.dtype])


def rotate_float64(x: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The exact rotation of x by the float32 table, in float64."""
    half = x.shape[-1] // 2
    table = cos_sin[positions].double()[:, None, :]  # [num_tokens, 1, head_dim]
    cos, sin = table[..., :half], table[..., half:]
    x1, x2 = x[..., :half].double(), x[..., half:].double()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def assert_rotated(
    actual: torch.Tensor, before: torch.Tensor, cos_sin, positions, expected: torch.Tensor
) -> None:
    """actual: the kernel's result for input `before`; expected: the torch reference's."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
        return
    ulp = pair_ulp(before)
    to_exact = (actual.double() - rotate_float64(before, cos_sin, positions)).abs() / ulp
    assert to_exact.max().item() <= 1.01, f"{to_exact.max().item()} ulp from the float64 rotation"
    to_reference = (actual.float() - expected.float()).abs() / ulp
    assert to_reference.max().item() <= 2, f"{to_reference.max().item()} ulp from the reference"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "num_tokens,num_heads,num_kv_heads,head_dim",
    # 12: a half of 6 is no power of two; 40 heads of 128: two loop steps of 32 heads, the second masked.
    [(1, 1, 1, 2), (3, 4, 2, 16), (5, 6, 2, 12), (2, 3, 3, 128), (1, 40, 2, 128)],
)
def test_views_into_qkv_match_reference(device, dtype, num_tokens, num_heads, num_kv_heads, head_dim):
    qkv, query, key, value = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, dtype, device)
    cos_sin = make_cos_sin(64, head_dim, 10000.0, device)
    positions = torch.randint(0, 64, (num_tokens,), generator=torch.Generator().manual_seed(1)).to(device)
    query_before, key_before, value_before = query.clone(), key.clone(), value.clone()
    expected_query, expected_key = apply_rotary_reference(query_before, key_before, cos_sin, positions)
    assert apply_rotary(query, key, cos_sin, positions) is None
    assert_rotated(query, query_before, cos_sin, positions, expected_query)
    assert_rotated(key, key_before, cos_sin, positions, expected_key)
    assert torch.equal(value, value_before)  # v shares the rows and is left alone


def test_other_strides_and_int32_positions(device):
    """Head stride larger than head_dim, separate q and k buffers, unsorted repeated int32 positions."""
    dtype, num_tokens, head_dim = torch.float16, 4, 8
    generator = torch.Generator().manual_seed(2)
    query_buffer = torch.randn(num_tokens, 3, 2 * head_dim, generator=generator).to(dtype).to(device)
    key_buffer = torch.randn(num_tokens + 2, 2, head_dim, generator=generator).to(dtype).to(device)
    query, key = query_buffer[:, :, head_dim:], key_buffer[1 : num_tokens + 1]
    cos_sin = make_cos_sin(16, head_dim, 10000.0, device)
    positions = torch.tensor([7, 0, 7, 15], dtype=torch.int32, device=device)
    query_buffer_before, key_buffer_before = query_buffer.clone(), key_buffer.clone()
    expected_query, expected_key = apply_rotary_reference(
        query.clone(), key.clone(), cos_sin, positions.long()
    )
    apply_rotary(query, key, cos_sin, positions)
    assert_rotated(query, query_buffer_before[:, :, head_dim:], cos_sin, positions.long(), expected_query)
    assert_rotated(key, key_buffer_before[1 : num_tokens + 1], cos_sin, positions.long(), expected_key)
    assert torch.equal(query_buffer[:, :, :head_dim], query_buffer_before[:, :, :head_dim])
    assert torch.equal(key_buffer[0], key_buffer_before[0]) and torch.equal(
        key_buffer[-1], key_buffer_before[-1]
    )


def test_position_zero_is_identity(device):
    _, query, key, _ = make_qkv(2, 2, 1, 8, torch.float16, device)
    query_before, key_before = query.clone(), key.clone()
    apply_rotary(
        query, key, make_cos_sin(4, 8, 10000.0, device), torch.zeros(2, dtype=torch.int64, device=device)
    )
    assert torch.equal(query, query_before) and torch.equal(key, key_before)


def test_zero_tokens_is_a_no_op(device):
    _, query, key, _ = make_qkv(0, 2, 1, 8, torch.float32, device)
    apply_rotary(
        query, key, make_cos_sin(4, 8, 10000.0, device), torch.empty(0, dtype=torch.int64, device=device)
    )


BAD_CALLS = [  # (what the message names, call given q [2, 4, 8], k [2, 2, 8], cos_sin [16, 8], positions [2])
    ("query must be", lambda q, k, cs, p: apply_rotary(q[0], k, cs, p)),
    ("key has dtype", lambda q, k, cs, p: apply_rotary(q, k.half(), cs, p)),
    ("key has shape", lambda q, k, cs, p: apply_rotary(q, k[:, :, :4], cs, p)),
    ("head_dim must be even", lambda q, k, cs, p: apply_rotary(q[..., :7], k[..., :7], cs[:, :7], p)),
    ("cos_sin has shape", lambda q, k, cs, p: apply_rotary(q, k, cs[:, :4], p)),
    ("cos_sin has dtype", lambda q, k, cs, p: apply_rotary(q, k, cs.double(), p)),
    ("positions has shape", lambda q, k, cs, p: apply_rotary(q, k, cs, p[:1])),
    ("positions has dtype", lambda q, k, cs, p: apply_rotary(q, k, cs, p.float())),
    ("query must have a contiguous last dim", lambda q, k, cs, p: apply_rotary(q.transpose(1, 2), k, cs, p)),
    ("query has dtype", lambda q, k, cs, p: apply_rotary(q.long(), k, cs, p)),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[message for message, _ in BAD_CALLS])
def test_bad_inputs_raise_value_error_naming_the_problem(device, message, call):
    query, key = torch.randn(2, 4, 8, device=device), torch.randn(2, 2, 8, device=device)
    cos_sin, positions = make_cos_sin(16, 8, 10000.0, device), torch.tensor([0, 3], device=device)
    with pytest.raises(ValueError, match=message):
        call(query, key, cos_sin, positions)


# Real shapes: qwen2.5-1.5b (12/2 heads of 128, theta 1e6), tinyllama (32/4 heads of 64, theta 1e4).
GPU_MODELS = [(12, 2, 128, 1e6), (32, 4, 64, 1e4)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens", [1, 64, 256, 8192])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,theta", GPU_MODELS)
def test_gpu_bf16_matches_reference(num_tokens, num_heads, num_kv_heads, head_dim, theta):
    device = torch.device("cuda")
    _, query, key, value = make_qkv(num_tokens, num_heads, num_kv_heads, head_dim, torch.bfloat16, device)
    cos_sin = make_cos_sin(32768, head_dim, theta, device)
    positions = torch.randint(0, 32768, (num_tokens,), device=device)
    query_before, key_before, value_before = query.clone(), key.clone(), value.clone()
    expected_query, expected_key = apply_rotary_reference(query_before, key_before, cos_sin, positions)
    apply_rotary(query, key, cos_sin, positions)
    assert_rotated(query, query_before, cos_sin, positions, expected_query)
    assert_rotated(key, key_before, cos_sin, positions, expected_key)
    assert torch.equal(value, value_before)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_reads_new_positions():
    device = torch.device("cuda")
    qkv, query, key, _ = make_qkv(64, 12, 2, 128, torch.bfloat16, device)
    cos_sin = make_cos_sin(4096, 128, 1e6, device)
    positions = torch.zeros(64, dtype=torch.int64, device=device)
    source = qkv.clone()
    apply_rotary(query, key, cos_sin, positions)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_rotary(query, key, cos_sin, positions)
    qkv.copy_(source)
    positions.copy_(torch.randint(0, 4096, (64,), device=device))
    graph.replay()
    torch.cuda.synchronize()
    _, query_before, key_before, _ = make_qkv(64, 12, 2, 128, torch.bfloat16, device)
    expected_query, expected_key = apply_rotary_reference(query_before, key_before, cos_sin, positions)
    assert_rotated(query, query_before, cos_sin, positions, expected_query)
    assert_rotated(key, key_before, cos_sin, positions, expected_key)

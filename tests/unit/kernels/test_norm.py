"""RMSNorm and fused add + RMSNorm against the torch reference of engine/models/llama.py.

Tolerances. The kernel rounds where the reference rounds; only the float32 rstd may differ (summation
order), and where it puts the normalised value on the other side of a dtype rounding boundary that value
is 1 ulp off, which the weight product can make 2 ulp of the output. So fp16/bf16: at most 2 ulp (1 with
a unit weight) and, on CUDA, at least 99.9% of elements bit-identical; the residual sum is bit-identical.
float32: rtol 1e-5. CPU (interpreter): tiny shapes in float32/float16; CUDA (gpu): bf16 at real shapes.
"""

from __future__ import annotations

import pytest
import torch
from ulp import ulp_distance

from engine.kernels.norm import fused_add_rms_norm, rms_norm
from engine.kernels.reference import fused_add_rms_norm_reference, rms_norm_reference

ON_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
EPS = 1e-6


def assert_matches(
    actual: torch.Tensor, expected: torch.Tensor, max_ulp: int = 2, min_exact: float = 0.99
) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        return
    distance = ulp_distance(actual, expected)
    assert distance.max().item() <= max_ulp, f"max ulp distance {distance.max().item()}"
    exact = (distance == 0).float().mean().item()
    assert exact >= min_exact, f"only {exact:.5f} of elements bit-identical"


def make_rows(num_tokens: int, hidden: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(num_tokens, hidden, generator=generator) * 3).to(dtype).to(device)
    weight = (torch.rand(hidden, generator=generator) * 2).to(dtype).to(device)
    residual = torch.randn(num_tokens, hidden, generator=generator).to(dtype).to(device)
    return x, weight, residual


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 1), (3, 48), (2, 100), (1, 1000)])
def test_rms_norm_matches_reference(device, dtype, num_tokens, hidden):
    x, weight, _ = make_rows(num_tokens, hidden, dtype, device)
    assert_matches(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS))
    ones = torch.ones_like(weight)
    assert_matches(rms_norm(x, ones, EPS), rms_norm_reference(x, ones, EPS), max_ulp=1)


def test_rms_norm_strided_rows_out_buffer_and_in_place(device):
    dtype, hidden = torch.float16, 40
    buffer = torch.randn(3, hidden + 8, dtype=dtype, device=device)
    x = buffer[:, 4 : 4 + hidden]  # row stride 48, last dim contiguous
    weight = torch.rand(hidden, dtype=dtype, device=device)
    expected = rms_norm_reference(x, weight, EPS)
    out_buffer = torch.full((3, 2 * hidden), 7.0, dtype=dtype, device=device)
    out = out_buffer[:, :hidden]
    assert rms_norm(x, weight, EPS, out=out) is out
    assert_matches(out, expected)
    assert (out_buffer[:, hidden:] == 7.0).all()  # nothing written past the view
    before = buffer.clone()
    rms_norm(x, weight, EPS, out=x)  # in place: each row is read whole before it is written
    assert_matches(x, expected)
    assert torch.equal(buffer[:, :4], before[:, :4]) and torch.equal(
        buffer[:, 4 + hidden :], before[:, 4 + hidden :]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,hidden", [(1, 32), (4, 72)])
def test_fused_add_rms_norm_writes_both_in_place(device, dtype, num_tokens, hidden):
    x, weight, residual = make_rows(num_tokens, hidden, dtype, device, seed=1)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert normed is x and new_residual is residual
    assert torch.equal(new_residual, expected_residual)  # the add rounds once, as the reference does
    assert_matches(normed, expected_normed)


def test_fused_add_rms_norm_strided_rows(device):
    dtype, hidden = torch.float16, 24
    x_buffer = torch.randn(5, 64, dtype=dtype, device=device)
    residual_buffer = torch.randn(5, 2 * hidden, dtype=dtype, device=device)
    x, residual = x_buffer[:, 8 : 8 + hidden], residual_buffer[:, hidden:]
    weight = torch.rand(hidden, dtype=dtype, device=device)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    untouched = residual_buffer[:, :hidden].clone()
    fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(residual, expected_residual)
    assert_matches(x, expected_normed)
    assert torch.equal(residual_buffer[:, :hidden], untouched)


def test_zero_tokens_is_a_no_op(device):
    x = torch.empty(0, 16, device=device)
    weight = torch.ones(16, device=device)
    assert rms_norm(x, weight, EPS).shape == (0, 16)
    normed, residual = fused_add_rms_norm(x, torch.empty(0, 16, device=device), weight, EPS)
    assert normed.shape == residual.shape == (0, 16)


BAD_CALLS = [  # (what the message names, call given x [4, 16] float32 and weight [16])
    ("x must be", lambda x, w: rms_norm(x[0], w, EPS)),
    ("x has dtype", lambda x, w: rms_norm(x.to(torch.int32), w, EPS)),
    ("weight has shape", lambda x, w: rms_norm(x, w[:8], EPS)),
    ("weight has dtype", lambda x, w: rms_norm(x, w.half(), EPS)),
    ("x must have a contiguous last dim", lambda x, w: rms_norm(x.t().contiguous().t(), w, EPS)),
    ("out has shape", lambda x, w: rms_norm(x, w, EPS, out=x[:, :8])),
    ("out has dtype", lambda x, w: rms_norm(x, w, EPS, out=x.half())),
    ("residual has shape", lambda x, w: fused_add_rms_norm(x, x[:3].clone(), w, EPS)),
    ("residual has dtype", lambda x, w: fused_add_rms_norm(x, x.half(), w, EPS)),
    ("distinct buffers", lambda x, w: fused_add_rms_norm(x, x, w, EPS)),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[message for message, _ in BAD_CALLS])
def test_bad_inputs_raise_value_error_naming_the_problem(device, message, call):
    x = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match=message):
        call(x, torch.ones(16, device=device))


# Real shapes: qwen2.5-1.5b (hidden 1536), tinyllama (2048); decode to long prefill.
GPU_SHAPES = [(n, h) for h in (1536, 2048) for n in (1, 64, 256, 8192)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens,hidden", GPU_SHAPES)
def test_gpu_bf16_matches_reference(num_tokens, hidden):
    device = torch.device("cuda")
    x, weight, residual = make_rows(num_tokens, hidden, torch.bfloat16, device, seed=num_tokens)
    assert_matches(rms_norm(x, weight, EPS), rms_norm_reference(x, weight, EPS), max_ulp=2, min_exact=0.999)
    expected_normed, expected_residual = fused_add_rms_norm_reference(x, residual, weight, EPS)
    normed, new_residual = fused_add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(new_residual, expected_residual)
    assert_matches(normed, expected_normed, max_ulp=2, min_exact=0.999)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_reads_new_inputs():
    device = torch.device("cuda")
    x, weight, residual = make_rows(64, 1536, torch.bfloat16, device)
    attn_out, residual_in = x.clone(), residual.clone()
    out = torch.empty_like(x)
    rms_norm(x, weight, EPS, out=out)  # compile outside the capture
    fused_add_rms_norm(attn_out.clone(), residual_in.clone(), weight, EPS)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rms_norm(x, weight, EPS, out=out)
        fused_add_rms_norm(attn_out, residual_in, weight, EPS)
    new_x, _, new_residual = make_rows(64, 1536, torch.bfloat16, device, seed=5)
    x.copy_(new_x)
    attn_out.copy_(new_x)
    residual_in.copy_(new_residual)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, rms_norm_reference(new_x, weight, EPS), min_exact=0.999)
    expected_normed, expected_residual = fused_add_rms_norm_reference(new_x, new_residual, weight, EPS)
    assert torch.equal(residual_in, expected_residual)
    assert_matches(attn_out, expected_normed, min_exact=0.999)

"""silu(gate) * up against the torch reference of engine/models/llama.py (`F.silu(gate) * up` in the dtype).

Tolerances. The kernel rounds where the reference rounds. On CUDA it computes silu as torch's kernel
does (libdevice expf, IEEE division), so bf16 is expected bit-identical; asserted: every element within
2 ulp and at least 99.9% identical (a silu value 1 ulp off, after the product with up, is up to 2 ulp).
The interpreter takes numpy's exp, torch on CPU its own: fp16 within 2 ulp there; float32 rtol 1e-5.
"""

from __future__ import annotations

import pytest
import torch
from ulp import ulp_distance

from engine.kernels.activation import BLOCK, silu_and_mul
from engine.kernels.reference import silu_and_mul_reference

ON_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, min_exact: float = 0.99) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
        return
    distance = ulp_distance(actual, expected)
    assert distance.max().item() <= 2, f"max ulp distance {distance.max().item()}"
    exact = (distance == 0).float().mean().item()
    assert exact >= min_exact, f"only {exact:.5f} of elements bit-identical"


def make_gate_up(num_tokens: int, inter: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(num_tokens, 2 * inter, generator=generator) * 3).to(dtype).to(device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,inter", [(1, 1), (3, 5), (2, BLOCK + 6)])  # the last crosses a block
def test_matches_reference(device, dtype, num_tokens, inter):
    gate_up = make_gate_up(num_tokens, inter, dtype, device)
    out = silu_and_mul(gate_up)
    assert out.shape == (num_tokens, inter)
    assert_matches(out, silu_and_mul_reference(gate_up))


@pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning")  # numpy's exp(100) in the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_extreme_gates(device, dtype):
    """exp(-gate) overflows for very negative gates: silu is then -0, as in torch; large gates pass through."""
    gate = torch.tensor([-100.0, -88.0, -20.0, -1.0, 0.0, 1e-3, 1.0, 20.0, 100.0, 1000.0])
    up = torch.tensor([1.0, -2.0, 3.0, 0.5, 7.0, 1.0, -1.0, 2.0, 0.25, 0.01])
    gate_up = torch.cat([gate, up])[None, :].to(dtype).to(device)
    out = silu_and_mul(gate_up)
    assert torch.isfinite(out).all()
    assert_matches(out, silu_and_mul_reference(gate_up))


def test_strided_rows_and_out_buffer(device):
    dtype, inter = torch.float16, 24
    buffer = make_gate_up(3, inter + 4, dtype, device)
    gate_up = buffer[:, 8:]  # [3, 48], row stride 56
    out_buffer = torch.full((3, inter + 16), 5.0, dtype=dtype, device=device)
    out = out_buffer[:, 16:]
    assert silu_and_mul(gate_up, out=out) is out
    assert_matches(out, silu_and_mul_reference(gate_up))
    assert (out_buffer[:, :16] == 5.0).all()


def test_zero_tokens_is_a_no_op(device):
    assert silu_and_mul(torch.empty(0, 8, device=device)).shape == (0, 4)


BAD_CALLS = [  # (what the message names, call given gate_up [4, 16] float32)
    ("gate_up must be", lambda g: silu_and_mul(g[0])),
    ("gate_up has dtype", lambda g: silu_and_mul(g.to(torch.int32))),
    ("must be even", lambda g: silu_and_mul(g[:, :15])),
    ("gate_up must have a contiguous last dim", lambda g: silu_and_mul(g.t().contiguous().t())),
    ("out has shape", lambda g: silu_and_mul(g, out=g.new_empty(4, 16))),
    ("out has dtype", lambda g: silu_and_mul(g, out=g.new_empty(4, 8, dtype=torch.float16))),
    ("out must have a contiguous last dim", lambda g: silu_and_mul(g, out=g.new_empty(8, 4).t())),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[message for message, _ in BAD_CALLS])
def test_bad_inputs_raise_value_error_naming_the_problem(device, message, call):
    with pytest.raises(ValueError, match=message):
        call(torch.randn(4, 16, device=device))


# Real shapes: qwen2.5-1.5b (intermediate 8960), tinyllama (5632); decode to long prefill.
GPU_SHAPES = [(n, inter) for inter in (8960, 5632) for n in (1, 64, 256, 8192)]


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("num_tokens,inter", GPU_SHAPES)
def test_gpu_bf16_matches_reference(num_tokens, inter):
    gate_up = make_gate_up(num_tokens, inter, torch.bfloat16, torch.device("cuda"), seed=num_tokens)
    assert_matches(silu_and_mul(gate_up), silu_and_mul_reference(gate_up), min_exact=0.999)


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_reads_new_inputs():
    device = torch.device("cuda")
    gate_up = make_gate_up(64, 8960, torch.bfloat16, device)
    out = torch.empty(64, 8960, dtype=torch.bfloat16, device=device)
    silu_and_mul(gate_up, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        silu_and_mul(gate_up, out=out)
    gate_up.copy_(make_gate_up(64, 8960, torch.bfloat16, device, seed=3))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, silu_and_mul_reference(gate_up), min_exact=0.999)

"""The skinny matmul (engine.kernels.gemv) against torch: plain, with bias, with silu(gate) * up applied
to its input, with K split across programs, and the split-K counters left at zero for the next launch.

Tolerances. The kernel sums in float32 in another order than torch, so results differ by rounding:
float32 within rtol 1e-5 (products in IEEE, not tf32); fp16 and bf16 outputs within one rounding of the
float32 result (relative 2**-10 / 2**-7), plus an absolute 1e-4 for results near zero, whose ulps are
smaller than the float32 sums' own error. The silu input is
rounded as the activation kernel rounds, so the reference is `silu_and_mul_reference` then the matmul.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import gemv as gemv_module
from engine.kernels.gemv import MAX_ROWS, GemvConfig, gemv
from engine.kernels.reference import silu_and_mul_reference

ON_CUDA = torch.cuda.is_available()
# Interpreter shapes are tiny; on CUDA the qwen2.5-1.5b projections (qkv with bias, o, gate_up, down).
SHAPES = (
    [(40, 96), (16, 48), (33, 160)]
    if not ON_CUDA
    else [(2048, 1536), (1536, 1536), (17920, 1536), (1536, 8960)]
)
SMALL = GemvConfig(block_n=16, block_k=32, split_k=1)


def make(shape, dtype, device, seed, scale=1.0):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=generator) * scale).to(dtype).to(device)


def expected(x, weight, bias=None):
    result = x.float() @ weight.float().T
    if bias is not None:
        result += bias.float()
    return result


def assert_close(actual: torch.Tensor, exact: torch.Tensor) -> None:
    """actual (the kernel, in its dtype) against the float32 result of the same inputs."""
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, exact, rtol=1e-5, atol=1e-5)
        return
    rounding = 2.0**-10 if actual.dtype == torch.float16 else 2.0**-7
    torch.testing.assert_close(actual.float(), exact, rtol=rounding, atol=1e-4)


def dtypes():
    return [torch.bfloat16, torch.float16] if ON_CUDA else [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("rows", [1, 3, MAX_ROWS])
@pytest.mark.parametrize("split_k", [1, 2, 3])
def test_matches_matmul(device, dtype, rows, split_k):
    for n, k in SHAPES[:2]:
        x = make((rows, k), dtype, device, 0)
        weight = make((n, k), dtype, device, 1, scale=k**-0.5)
        bias = make((n,), dtype, device, 2)
        config = None if ON_CUDA else GemvConfig(16, 32, split_k)
        assert_close(gemv(x, weight, config=config), expected(x, weight))
        assert_close(gemv(x, weight, bias, config=config), expected(x, weight, bias))


@pytest.mark.parametrize("dtype", dtypes())
@pytest.mark.parametrize("split_k", [1, 2])
def test_silu_mul_input(device, dtype, split_k):
    """down_proj(silu(gate) * up) in one launch equals the activation, rounded, then the matmul."""
    n, k = SHAPES[-1]
    gate_up = make((2, 2 * k), dtype, device, 3, scale=2.0)
    weight = make((n, k), dtype, device, 4, scale=k**-0.5)
    config = None if ON_CUDA else GemvConfig(16, 32, split_k)
    out = gemv(gate_up, weight, silu_mul_input=True, config=config)
    activated = silu_and_mul_reference(gate_up)
    # The interpreter's exp is numpy's, torch's its own: the activation may differ by an ulp there, so
    # on CPU compare with a tolerance of the size that ulp makes after the matmul.
    if ON_CUDA or dtype == torch.float32:
        assert_close(out, expected(activated, weight))
    else:
        torch.testing.assert_close(out.float(), expected(activated, weight), rtol=2e-2, atol=2e-2)


def test_split_k_counters_reset_and_replays_agree(device):
    """The last program of each tile resets its counter: a second launch finds zeros and agrees bit for bit."""
    dtype = torch.float16
    n, k = SHAPES[0]
    x = make((2, k), dtype, device, 5)
    weight = make((n, k), dtype, device, 6, scale=k**-0.5)
    config = GemvConfig(16, 32, 3)
    first = gemv(x, weight, config=config)
    counters = gemv_module._counters_for(x.device)
    assert int(counters.count_nonzero()) == 0
    second = gemv(x, weight, config=config)
    assert torch.equal(first, second)


def test_strided_rows_and_out_buffer(device):
    """Rows of a wider tensor (a view), and an out buffer that is a view too."""
    dtype = torch.float16
    n, k = SHAPES[0]
    wide = make((3, k + 8), dtype, device, 7)
    x = wide[:, :k]
    weight = make((n, k), dtype, device, 8, scale=k**-0.5)
    out_wide = torch.zeros(3, n + 4, dtype=dtype, device=device)
    out = out_wide[:, :n]
    gemv(x, weight, out=out, config=None if ON_CUDA else SMALL)
    assert_close(out, expected(x, weight))
    assert torch.count_nonzero(out_wide[:, n:]) == 0


def test_heuristic_splits_k_only_when_the_row_tiles_are_few():
    from engine.kernels.gemv import choose_config

    wide = choose_config(151936, 1536, False, num_sms=132)
    assert wide.split_k == 1  # thousands of row tiles fill the GPU by themselves
    narrow = choose_config(1536, 8960, True, num_sms=132)
    assert narrow.split_k > 1
    assert (1536 // narrow.block_n) * narrow.split_k >= 132


@pytest.mark.parametrize(
    "x_shape,w_shape,kwargs,message",
    [
        ((MAX_ROWS + 1, 32), (16, 32), {}, "at most"),
        ((2, 33), (16, 32), {}, "expected K"),
        ((2, 32), (16, 32), {"silu_mul_input": True}, "gate, then up"),
        ((2, 32), (16, 32), {"bias": "wrong"}, "bias must be"),
    ],
)
def test_bad_arguments_raise(device, x_shape, w_shape, kwargs, message):
    x = torch.zeros(x_shape, dtype=torch.float16, device=device)
    weight = torch.zeros(w_shape, dtype=torch.float16, device=device)
    if kwargs.get("bias") == "wrong":
        kwargs = {"bias": torch.zeros(w_shape[0] + 1, dtype=torch.float16, device=device)}
    with pytest.raises(ValueError, match=message):
        gemv(x, weight, **kwargs)


def test_dtype_mismatch_raises(device):
    with pytest.raises(ValueError, match="share a dtype"):
        gemv(torch.zeros(1, 32, device=device), torch.zeros(16, 32, dtype=torch.float16, device=device))

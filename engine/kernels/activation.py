"""SiLU-and-multiply of the MLP: silu(gate) * up from the merged gate_up projection, one Triton kernel.

The MLP of engine/models/llama.py calls `silu_and_mul` between gate_up_proj and down_proj. Rounding
mirrors torch's `F.silu(gate) * up` in the model dtype: silu in float32 rounded to the dtype, then the
product rounded; `silu_and_mul_reference` is that torch code, for tests and bench.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK = 1024  # columns a program handles: 8 bf16 (16 bytes) a thread with 4 warps
# Triton reads TRITON_INTERPRET when imported; its interpreter has no libdevice.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr, TORCH_EXP: tl.constexpr):
    """silu(gate) * up from float32 gate and up, rounded to dtype where torch's `F.silu(gate) * up` rounds.

    Shared by the activation kernel and the skinny matmul that applies it to its input (engine.kernels.gemv).
    """
    # torch's CUDA silu is x / (1 + expf(-x)) with an IEEE division; libdevice's expf and div_rn
    # reproduce it bit for bit. The interpreter has no libdevice: it takes numpy's exp instead.
    if TORCH_EXP:
        exp_neg = libdevice.exp(-gate)
    else:
        exp_neg = tl.exp(-gate)
    silu = tl.math.div_rn(gate, 1.0 + exp_neg).to(dtype)
    # The float32 product of two bf16/fp16 values is exact, so one rounding equals torch's.
    return (silu.to(tl.float32) * up).to(dtype)


@triton.jit
def _silu_and_mul_kernel(
    gate_up_ptr,  # [num_tokens, 2 * inter], row stride gate_up_row_stride
    out_ptr,  # [num_tokens, inter], row stride out_row_stride
    gate_up_row_stride,
    out_row_stride,
    inter,
    TORCH_EXP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: num_tokens * row_stride can pass 2**31
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate_ptrs = gate_up_ptr + row * gate_up_row_stride + cols
    gate = tl.load(gate_ptrs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptrs + inter, mask=mask, other=0.0).to(tl.float32)
    out = silu_mul(gate, up, out_ptr.dtype.element_ty, TORCH_EXP)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """silu(gate_up[:, :inter]) * gate_up[:, inter:], rounded as `silu_and_mul_reference`.

    gate_up: [num_tokens, 2 * inter] bf16/fp16/fp32, last dim contiguous (any row stride).
    out: optional [num_tokens, inter] buffer of the same dtype, last dim contiguous; must not overlap
    gate_up. Returns out, or a new tensor.
    """
    if gate_up.dim() != 2:
        raise ValueError(f"gate_up must be [num_tokens, 2 * inter], got shape {tuple(gate_up.shape)}")
    if gate_up.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"gate_up has dtype {gate_up.dtype}; supported: {SUPPORTED_DTYPES}")
    num_tokens, width = gate_up.shape
    if width % 2 != 0:
        raise ValueError(f"gate_up's last dim must be even (gate then up), got {width}")
    if width > 1 and gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must have a contiguous last dim, got strides {gate_up.stride()}")
    inter = width // 2
    if out is None:
        out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    else:
        if out.shape != (num_tokens, inter):
            raise ValueError(f"out has shape {tuple(out.shape)}, expected ({num_tokens}, {inter})")
        if out.dtype != gate_up.dtype:
            raise ValueError(f"out has dtype {out.dtype}, expected {gate_up.dtype}")
        if out.device != gate_up.device:
            raise ValueError(f"out is on {out.device}, expected {gate_up.device}")
        if inter > 1 and out.stride(1) != 1:
            raise ValueError(f"out must have a contiguous last dim, got strides {out.stride()}")
    if num_tokens == 0 or inter == 0:
        return out
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(inter, BLOCK))](
        gate_up,
        out,
        gate_up.stride(0),
        out.stride(0),
        inter,
        TORCH_EXP=gate_up.is_cuda and not INTERPRETED,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return out

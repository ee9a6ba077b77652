"""RMSNorm, alone and fused with the residual add before it: one Triton program per token row.

The decoder layer calls these in place of its torch RMSNorm (engine/models/llama.py); the rounding
mirrors that module, which mirrors transformers: normalise in float32, round to the model dtype,
multiply by the weight in the model dtype. `rms_norm_reference` is that torch code, for tests and bench.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# A row is loaded as one block of next_power_of_2(hidden) elements; past this it would spill registers.
MAX_HIDDEN = 32768


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_tokens, hidden], row stride x_row_stride
    residual_ptr,  # [num_tokens, hidden] or unused when not HAS_RESIDUAL
    weight_ptr,  # [hidden]
    out_ptr,  # [num_tokens, hidden]
    x_row_stride,
    residual_row_stride,
    out_row_stride,
    hidden,
    inverse_hidden,  # 1 / hidden in float32: torch's mean multiplies the sum by it
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: num_tokens * row_stride can pass 2**31
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * residual_row_stride + cols, mask=mask, other=0.0)
        # The reference adds in the model dtype: float32 sum, rounded once to the dtype.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_ptr + row * residual_row_stride + cols, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) * inverse_hidden
    normed = (h * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    # weight * normed in the dtype: the float32 product of two bf16/fp16 values is exact, so one
    # rounding here equals torch's.
    out = (weight.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * out_row_stride + cols, out, mask=mask)


def _check_rows(name: str, tensor: torch.Tensor, like: torch.Tensor) -> None:
    """tensor must have like's shape, dtype and device, with a contiguous last dim (any row stride)."""
    if tensor.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(like.shape)}")
    if tensor.dtype != like.dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected {like.dtype}")
    if tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device}, expected {like.device}")
    if tensor.shape[-1] > 1 and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim, got strides {tensor.stride()}")


def _check_input(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden], got shape {tuple(x.shape)}")
    if x.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"x has dtype {x.dtype}; supported: {SUPPORTED_DTYPES}")
    hidden = x.shape[1]
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"hidden size {hidden} outside 1..{MAX_HIDDEN}")
    _check_rows("x", x, x)
    if weight.dim() != 1 or weight.shape[0] != hidden:
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({hidden},)")
    if weight.dtype != x.dtype:
        raise ValueError(f"weight has dtype {weight.dtype}, expected x's {x.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight is on {weight.device}, expected {x.device}")
    if weight.stride(0) != 1:
        raise ValueError("weight must be contiguous")


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, out: torch.Tensor
) -> None:
    num_tokens, hidden = x.shape
    if num_tokens == 0:
        return
    block = triton.next_power_of_2(hidden)
    # About eight elements a thread (16-byte loads in bf16), at most 16 warps.
    num_warps = min(max(block // 256, 1), 16)
    _rms_norm_kernel[(num_tokens,)](
        x,
        residual if residual is not None else x,
        weight,
        out,
        x.stride(0),
        residual.stride(0) if residual is not None else 0,
        out.stride(0),
        hidden,
        1.0 / hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=num_warps,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of each row: weight * (x / sqrt(mean(x^2) + eps)), rounded as `rms_norm_reference`.

    x: [num_tokens, hidden] bf16/fp16/fp32, last dim contiguous; weight: [hidden], same dtype.
    out: optional [num_tokens, hidden] buffer of x's dtype (may be x itself: each row is read whole
    before it is written). Returns out, or a new tensor.
    """
    _check_input(x, weight)
    if out is None:
        out = torch.empty_like(x)
    else:
        _check_rows("out", out, x)
    _launch(x, None, weight, eps, out)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x (rounded to the dtype), then RMSNorm of the sum; both written in place.

    x, residual: [num_tokens, hidden] bf16/fp16/fp32, last dim contiguous, distinct buffers;
    weight: [hidden]. On return `residual` holds residual + x and `x` holds the normed rows;
    the result is the pair (x, residual), so a decoder layer reads
    `normed, residual = fused_add_rms_norm(attn_out, residual, weight, eps)`.
    """
    _check_input(x, weight)
    _check_rows("residual", residual, x)
    if residual.data_ptr() == x.data_ptr() and x.numel() > 0:
        raise ValueError("x and residual must be distinct buffers (both are written in place)")
    _launch(x, residual, weight, eps, x)
    return x, residual

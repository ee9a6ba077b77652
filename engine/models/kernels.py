"""The Triton kernels the model calls on its fast path, imported on first use.

The model's torch path (CPU, the reference) must import and run where triton is not installed, so
the decoder reaches the kernels through these thin forwarders rather than importing them at the top.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    from engine.kernels.norm import rms_norm as kernel

    return kernel(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from engine.kernels.norm import fused_add_rms_norm as kernel

    return kernel(x, residual, weight, eps)


def apply_rotary(
    query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> None:
    from engine.kernels.rotary import apply_rotary as kernel

    kernel(query, key, cos_sin, positions)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    from engine.kernels.activation import silu_and_mul as kernel

    return kernel(gate_up)


def gemv_rows(out_features: int, in_features: int, silu_mul_input: bool = False) -> int:
    """Projections of this weight shape and at most this many rows take the skinny matmul (0: never,
    for shapes where it was not measured faster than cuBLAS); more rows go to cuBLAS."""
    from engine.kernels.gemv import FASTER_THAN_CUBLAS_ROWS, wins

    return FASTER_THAN_CUBLAS_ROWS if wins(out_features, in_features, silu_mul_input) else 0


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, silu_mul_input: bool = False
) -> torch.Tensor:
    from engine.kernels.gemv import gemv as kernel

    return kernel(x, weight, bias, silu_mul_input=silu_mul_input, check=False)

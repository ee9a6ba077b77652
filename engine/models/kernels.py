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

"""The torch references of the elementwise kernels: what the model runs without them (CPU, the torch
attention backend) and what the kernel tests compare against. Plain torch, no triton import, so the
engine imports on machines without triton. Each mirrors transformers' order of roundings.
"""

from __future__ import annotations

import torch


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch RMSNorm of engine/models/llama.py (transformers' order of roundings)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def fused_add_rms_norm_reference(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out of place: (rms_norm_reference(residual + x), residual + x), the sum in the dtype."""
    new_residual = residual + x
    return rms_norm_reference(new_residual, weight, eps), new_residual


def reference_cos_sin(
    cos_sin: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for these positions rounded to dtype, [num_tokens, 1, head_dim] each, as the model
    computes them once a step (RotaryEmbedding.cos_sin_for)."""
    half = cos_sin.shape[1] // 2
    table = cos_sin[positions]  # [num_tokens, head_dim]
    cos = table[:, :half].repeat(1, 2)[:, None, :].to(dtype)
    sin = table[:, half:].repeat(1, 2)[:, None, :].to(dtype)
    return cos, sin


def rotate_reference(
    query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's per-layer torch rotary, out of place: every op rounded to the dtype."""
    half = query.shape[-1] // 2

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin


def apply_rotary_reference(
    query: torch.Tensor, key: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's torch rotary, out of place: cos/sin rounded to the dtype, each op rounded."""
    return rotate_reference(query, key, *reference_cos_sin(cos_sin, positions, query.dtype))


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """The model's torch MLP activation: F.silu(gate) * up in the dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up

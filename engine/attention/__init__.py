"""Attention backends behind one interface, chosen by name through a small registry.

A backend has `prepare(meta)` (once per step: what every layer shares), `forward(q, k, v, kv_cache,
meta, scale)` (store this step's K/V, attend), `supports_cuda_graphs` and `fuses_rotary`: where True,
the model may hand the rotary embedding to `forward(..., rotary=(cos_sin, positions))` and the backend
rotates q and k in the same launch that stores K/V. `get_backend("auto", device)` picks Triton on CUDA
when triton is installed, else the torch reference; every backend must agree with the torch reference.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata, RotaryInputs, current_metadata, forward_context
from engine.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str
    supports_cuda_graphs: bool
    # forward accepts rotary=(cos_sin, positions): q and k arrive unrotated, the backend rotates them
    # in place (the kernels' float32 rotation, engine.kernels.rotary) as it stores K/V.
    fuses_rotary: bool

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor: ...


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def get_backend(name: str = "auto", device: torch.device | None = None) -> AttentionBackend:
    if name not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend {name!r} (known: {', '.join(BACKEND_NAMES)})")
    if name == "auto":
        on_cuda = device is not None and device.type == "cuda"
        name = "triton" if on_cuda and triton_available() else "torch"
    if name == "torch":
        return TorchAttentionBackend()
    if not triton_available():
        raise ValueError("attention backend 'triton' needs the triton package, which is not installed")
    from engine.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


__all__ = [
    "BACKEND_NAMES",
    "AttentionBackend",
    "AttentionMetadata",
    "RotaryInputs",
    "current_metadata",
    "forward_context",
    "get_backend",
]

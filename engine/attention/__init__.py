"""Attention backends behind one interface, chosen by name through a small registry.

A backend has `prepare(meta)` (once per step: what every layer shares), `forward(q, k, v, kv_cache,
meta, scale)` (store this step's K/V, attend), and `supports_cuda_graphs`. `get_backend("auto",
device)` picks Triton on CUDA when triton is installed, else the torch reference; every backend
must agree with the torch reference.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata, current_metadata, forward_context
from engine.attention.torch_backend import TorchAttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


class AttentionBackend(Protocol):
    name: str
    supports_cuda_graphs: bool

    def prepare(self, meta: AttentionMetadata) -> None: ...

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
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
    "current_metadata",
    "forward_context",
    "get_backend",
]

"""Attention backends behind one interface, chosen by name through a small registry.

`get_backend("auto", device)` picks the fastest backend available for the device; every backend
must agree with the torch reference.
"""

from __future__ import annotations

from engine.attention.metadata import AttentionMetadata, current_metadata, forward_context
from engine.attention.torch_backend import TorchAttentionBackend

_BACKENDS = {"torch": TorchAttentionBackend}


def get_backend(name: str = "auto") -> TorchAttentionBackend:
    if name == "auto":
        name = "torch"
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (known: {sorted(_BACKENDS)})")
    return _BACKENDS[name]()


__all__ = ["AttentionMetadata", "current_metadata", "forward_context", "get_backend"]

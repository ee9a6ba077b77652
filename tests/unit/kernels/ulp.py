"""Distance in units in the last place, for tolerances stated in representable values (the norm and
activation kernels reproduce the torch references' roundings, so they are compared this way)."""

from __future__ import annotations

import torch


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise count of representable values between a and b (same dtype), as int64."""
    assert a.dtype == b.dtype
    bits = {
        torch.float32: (torch.int32, 31),
        torch.float16: (torch.int16, 15),
        torch.bfloat16: (torch.int16, 15),
    }
    int_dtype, sign_bit = bits[a.dtype]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        raw = t.contiguous().view(int_dtype).long()
        return torch.where(raw < 0, -(raw & ((1 << sign_bit) - 1)), raw)  # -0 and +0 both map to 0

    return (ordered(a) - ordered(b)).abs()

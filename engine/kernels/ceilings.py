"""The physical ceilings that speed figures are held against, measured on the device at hand.

A large device-to-device copy gives the memory ceiling (bytes read + written per second); a dense bf16
matmul the tensor-core ceiling. The kernel micro-benchmarks and `python -m engine.profile` report
their figures as fractions of these, so a reader sees how far each is from the limit.
"""

from __future__ import annotations

import functools

import torch

from engine.kernels.timing import eager_ms


def copy_bandwidth_gbs(device: torch.device, size_bytes: int = 2 << 30) -> float:
    """GB/s of a device-to-device copy of size_bytes, counting the bytes read and the bytes written."""
    source = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    target = torch.empty_like(source)
    milliseconds = eager_ms(lambda: target.copy_(source), repeats=10)
    return 2 * size_bytes / (milliseconds / 1e3) / 1e9


def matmul_tflops(device: torch.device, size: int = 8192) -> float:
    """TFLOP/s of a dense size^3 bf16 matmul on random data."""
    a = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    b = torch.randn(size, size, dtype=torch.bfloat16, device=device)
    milliseconds = eager_ms(lambda: a @ b, repeats=10)
    return 2 * size**3 / (milliseconds / 1e3) / 1e12


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Streaming multiprocessors of a CUDA device (the H200's 132 where there is none: interpreter runs
    then size their grids as the device would)."""
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count

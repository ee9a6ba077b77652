"""What the kernel-lowering tests share: Triton for an H100/H200 (sm_90) on a machine without a GPU.

Importing this module skips the importing test module where Triton is missing, or where the kernels
are the interpreter's (TRITON_INTERPRET=1: Python functions, nothing to lower or bind).
"""

from __future__ import annotations

import importlib
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip(
        "the interpreter's kernels are not compiled: run without TRITON_INTERPRET", allow_module_level=True
    )

from triton.backends.compiler import GPUTarget  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
# Every module of engine.kernels that holds Triton kernels.
KERNEL_MODULES = tuple(
    importlib.import_module(f"engine.kernels.{name}")
    for name in (
        "activation",
        "decode_attention",
        "gemv",
        "kv_cache",
        "norm",
        "planned_decode_attention",
        "prefill_attention",
        "rotary",
        "sampling",
    )
)


def jit_kernels(module) -> dict[str, triton.runtime.JITFunction]:
    """The module's Triton kernels by attribute name (the names a launcher calls them by)."""
    return {
        key: value for key, value in vars(module).items() if isinstance(value, triton.runtime.JITFunction)
    }

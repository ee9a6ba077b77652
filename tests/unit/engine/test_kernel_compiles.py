"""Triton kernel variants compiled while serving are counted, reported and logged (engine.kernel_compiles).

On CPU nothing compiles, so Triton's compile hook is called here as Triton calls it on a cache miss
(keyword arguments); on the device tests/unit/engine/test_gpu.py serves steps of every kind and
expects the count to stay at 0.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams, kernel_compiles

knobs = pytest.importorskip("triton").knobs


def triton_compiles(name: str) -> None:
    """What Triton does on a miss of a kernel's in-process cache, before compiling it."""
    hook = knobs.runtime.jit_cache_hook
    assert hook is not None, "the engine set no compile hook"
    hook(
        key="k",
        repr=f"{name}[num_warps=4](x_ptr: *fp32)",
        fn=SimpleNamespace(name=name),
        compile={},
        is_manual_warmup=False,
        already_compiled=False,
    )


def test_a_compile_after_start_up_is_counted_and_logged(tiny_model_dir, caplog):
    llm = LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], params)
    assert llm.engine.stats().kernel_compiles == 0
    triton_compiles("_decode_plan_kernel")
    triton_compiles("_decode_split_kernel")
    assert llm.engine.stats().kernel_compiles == 2
    with caplog.at_level(logging.WARNING, logger="engine.engine"):
        llm.generate([[4, 5, 6]], params)
        llm.generate([[7, 8]], params)
    warnings = [r.getMessage() for r in caplog.records if "compiled while serving" in r.getMessage()]
    assert warnings == [
        "2 Triton kernel variant(s) compiled while serving (_decode_plan_kernel, _decode_split_kernel; 2 "
        "since the engine was ready): every request in flight waited for them; a variant the start-up "
        "did not meet"
    ]
    # A second engine in the process counts from its own start.
    other = LLM(str(tiny_model_dir), device="cpu", dtype="float32", max_model_len=256)
    assert other.engine.stats().kernel_compiles == 0 and llm.engine.stats().kernel_compiles == 2


def test_a_hook_set_before_is_still_called(monkeypatch):
    calls = []
    monkeypatch.setattr(kernel_compiles, "_installed", False)
    monkeypatch.setattr(kernel_compiles, "_kernels", [])
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kwargs: calls.append(kwargs["fn"].name))
    kernel_compiles.install()
    kernel_compiles.install()  # once a process: not wrapped twice
    triton_compiles("_rms_norm_kernel")
    assert calls == ["_rms_norm_kernel"] and kernel_compiles.compiled() == 1

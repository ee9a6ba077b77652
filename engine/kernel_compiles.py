"""Triton kernel variants compiled in this process, counted through Triton's compile hook.

Why: Triton compiles a kernel once per variant (its constexprs and the specialisation of its other
arguments), and a variant first met while serving compiles on the engine's loop: ~0.3-1 s on an H100
for an attention kernel, a stall of every request in flight. The kernels are written so that the
start-up (the profile run, the graph captures, the sampler's warm-up) meets every variant a step can
need (tests/unit/kernel_lowering/test_kernel_variants.py checks it on CPU through Triton's binder);
this count is the check on the device and the operator's warning where a shape or option still meets
a new one: the engine reports the variants compiled since it was ready (`EngineStats.kernel_compiles`,
`engine_kernel_compiles_total` in /metrics) and logs a warning after a step that compiled.

The hook fires on every miss of a kernel's in-process cache, before Triton looks in its on-disk cache:
a variant counts here even where the disk cache makes its compile cheap, as it does not on a fresh
machine. Nothing fires under TRITON_INTERPRET (nothing compiles) or without Triton.
"""

from __future__ import annotations

from typing import Any

_kernels: list[str] = []  # the kernel of each variant compiled, in order (a few dozen a process)
_installed = False


def install() -> None:
    """Count from now on (once a process; a hook set before is still called after ours). A no-op where
    Triton, or its hook, is missing."""
    global _installed
    if _installed:
        return
    try:
        from triton import knobs

        previous = knobs.runtime.jit_cache_hook
    except (ImportError, AttributeError):  # no Triton, or an older one without its knobs
        return

    def count(**kwargs: Any) -> Any:
        _kernels.append(getattr(kwargs.get("fn"), "name", "?"))
        return previous(**kwargs) if previous is not None else None

    knobs.runtime.jit_cache_hook = count
    _installed = True


def compiled() -> int:
    """Kernel variants compiled (in-process cache misses) since `install`."""
    return len(_kernels)


def kernels(since: int) -> list[str]:
    """The kernels of the variants compiled after the first `since`."""
    return _kernels[since:]

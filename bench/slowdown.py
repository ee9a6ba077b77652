"""Test-only: run a module with this project's engine made FACTOR times slower, to show that the
perf tier's budgets catch a slowdown (tests/unit/bench/test_smoke_catches_slowdown.py). Never part of
a measurement.

`python -m bench.slowdown FACTOR MODULE ARGS...` wraps `engine.LLMEngine.step` (for `server`, in its
engine core's process) so each call is
followed by (FACTOR − 1) x its own wall time of torch matmuls, then runs MODULE as `python -m MODULE
ARGS...` would. The extra time is spent computing, not sleeping, because that is what a slower
engine does on the CPU smoke's 2 cores: it keeps them from the HTTP path and the load generator,
where a sleep would hand them over. Matmuls, like the model's own work, release the GIL and run on
torch's intra-op threads.
bench.launch (the server) and bench.offline (the offline worker) start the engine through it when
PERF_INJECT_SLOWDOWN=FACTOR is set; like bench.offline_worker, it imports the engine only in that child.
"""

from __future__ import annotations

import functools
import os
import runpy
import sys
import time
from typing import Any

VARIABLE = "PERF_INJECT_SLOWDOWN"


def factor() -> float | None:
    """The factor PERF_INJECT_SLOWDOWN asks for, or None when it is unset (the normal case)."""
    text = os.environ.get(VARIABLE, "")
    if not text:
        return None
    value = float(text)
    if value < 1:
        raise ValueError(f"{VARIABLE}={text}: a slowdown factor is at least 1")
    return value


def wrap(command: list[str], target: str) -> list[str]:
    """`command` (`[python, "-m", MODULE, ...]`) through this module when a slowdown is asked for and
    the target is the engine; unchanged otherwise."""
    slowdown = factor()
    if slowdown is None or target != "engine":
        return command
    assert command[1] == "-m", command
    return [command[0], "-m", "bench.slowdown", f"{slowdown:g}", *command[2:]]


def compute_for(seconds: float) -> None:
    """Keep the CPU busy with torch matmuls (~0.5 ms each on 2 cores) for `seconds` of wall time."""
    import torch

    a = torch.ones(384, 384)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        torch.mm(a, a)


def slow_down_engine(slowdown: float) -> None:
    from engine import LLMEngine

    step = LLMEngine.step

    def slow_step(self: Any) -> Any:
        started = time.perf_counter()
        outputs = step(self)
        compute_for((slowdown - 1) * (time.perf_counter() - started))
        return outputs

    LLMEngine.step = slow_step  # type: ignore[method-assign]


def main() -> None:
    slowdown, module, *args = sys.argv[1:]
    print(f"[bench.slowdown] engine steps made {float(slowdown):g}x slower (test-only)", file=sys.stderr)
    if module == "server":
        # The server's engine steps in the engine core's process: the wrapper goes there.
        from server.cli import main as server_main

        raise SystemExit(server_main(args, core_setup=functools.partial(slow_down_engine, float(slowdown))))
    slow_down_engine(float(slowdown))
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()

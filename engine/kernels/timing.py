"""How the kernel micro-benchmarks and the ceilings time GPU work: one way, shared.

`graph_ms` captures a list of calls in one CUDA graph and replays it, which is how the engine's decode
step runs its kernels (no launch overhead between them); `eager_ms` launches a call from Python
back to back, launch overhead included. Both warm up first (compiling Triton kernels outside the
timing) and return the median over rounds. `load_kernel_module` imports another version of a kernel
module, so that a change is timed beside what it replaces, in one process on one GPU.
"""

from __future__ import annotations

import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch


def graph_ms(calls: list[Callable[[], object]], rounds: int = 7, replays: int = 10) -> float:
    """Milliseconds per call: the calls, in order, captured in one graph, replayed `replays` times a round.

    A list of calls over distinct data (more than the L2 cache holds in all) times the kernels as a step
    sees them, reading from HBM; the same call repeated times them with warm caches."""
    for call in calls:  # compile and warm the allocator outside the capture and the timing
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()  # warm-up replay, not timed
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (replays * len(calls)))
    del graph
    return statistics.median(times)


def eager_ms(call: Callable[[], object], repeats: int, rounds: int = 5) -> float:
    """Milliseconds per call launched from Python, `repeats` back to back a round, after a warm-up."""
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / repeats)
    return statistics.median(times)


def load_kernel_module(path: Path, launcher: str) -> ModuleType:
    """Another version of a kernel module (e.g. `git show REF:engine/kernels/decode_attention.py > FILE`),
    imported from its file under a name of its own, so its Triton kernels compile apart from this
    version's; `launcher` names the function it must have."""
    spec = importlib.util.spec_from_file_location(f"kernel_against_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ValueError(f"{path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # registered first, as an import does: its dataclasses look it up
    spec.loader.exec_module(module)
    if not callable(getattr(module, launcher, None)):
        raise ValueError(f"{path} has no {launcher}")
    return module

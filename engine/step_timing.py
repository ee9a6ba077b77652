"""Wall time of each phase of the engine's step, summed since start (or since `reset`).

`LLMEngine.step` wraps its phases (schedule, prepare, execute, update, outputs) in `phase(name)`;
`bench offline` and `engine.profile` read the totals, so a slower step names the phase that grew.
`execute` includes waiting for the GPU: the sampled tokens are read back at its end.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

PHASES = ("schedule", "prepare", "execute", "update", "outputs")


@dataclass
class StepTimer:
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    num_steps: int = 0

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> None:
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.num_steps = 0

    def summary(self) -> dict[str, float]:
        """Mean milliseconds per step of each phase, and of the whole step (`step_ms`)."""
        steps = max(self.num_steps, 1)
        out = {f"{name}_ms": 1e3 * total / steps for name, total in self.seconds.items()}
        out["step_ms"] = sum(out.values())
        out["num_steps"] = float(self.num_steps)
        return out

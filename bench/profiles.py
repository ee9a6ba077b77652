"""How much load the perf tier and `bench ab` send: the `full`, `short` and `smoke` profiles.

tests/perf/conftest.py picks one with `--profile`; bench.ab measures each side of an A/B with one
(`short` by default). A profile with `sweep=None` runs no open-loop sweep (the A/B tests' own).
"""

from __future__ import annotations

from dataclasses import dataclass

from bench.offline import OfflineLoad, Probes
from bench.runner import LoadConfig, SweepConfig


@dataclass(frozen=True)
class Profile:
    """How much load each case sends. `full`: levels of at least 15 s (~750 requests at vLLM's H200
    capacity); the sweep stretches a level to 3x the p90 latency where the server last kept up, up to
    60 s, so a slow server's trial takes longer (vLLM: ~5 minutes a trial on an H200); `short`:
    capacity and two closed-loop levels of both targets in one command; `smoke` exercises the whole
    pipeline on CPU in a few minutes. `offline`: the offline case's run (all at once, then the two
    probes), before the target's server starts."""

    name: str
    sweep: SweepConfig | None
    sweep_load: LoadConfig
    concurrencies: tuple[int, ...]
    closed_load: LoadConfig
    warmup: LoadConfig
    warmup_concurrency: int
    offline: OfflineLoad


PROFILES = {
    "full": Profile(
        name="full",
        sweep=SweepConfig(start_rate=1.0, max_levels=10, latency_multiple=3.0, max_level_s=60.0),
        sweep_load=LoadConfig(duration_s=15.0, progress=False),
        concurrencies=(1, 8, 32, 128, 256),
        closed_load=LoadConfig(duration_s=15.0, progress=False),
        warmup=LoadConfig(duration_s=15.0, progress=False),
        warmup_concurrency=64,
        offline=OfflineLoad(n_requests=1000, warmup=32),
    ),
    # Capacity and the closed loop at 1 and 128 of both targets in one 10-minute command (--target both).
    "short": Profile(
        name="short",
        sweep=SweepConfig(start_rate=1.0, max_levels=8, latency_multiple=2.0, max_level_s=20.0),
        sweep_load=LoadConfig(duration_s=10.0, progress=False),
        concurrencies=(1, 128),
        closed_load=LoadConfig(duration_s=10.0, progress=False),
        warmup=LoadConfig(duration_s=8.0, progress=False),
        warmup_concurrency=32,
        offline=OfflineLoad(n_requests=300, warmup=16),
    ),
    "smoke": Profile(
        name="smoke",
        # Levels of 8 requests, stretched only past 1x the latency: the pipeline, in about a minute.
        sweep=SweepConfig(start_rate=0.5, max_levels=4, latency_multiple=1.0),
        sweep_load=LoadConfig(n_requests=8, progress=False),
        concurrencies=(1, 4),
        closed_load=LoadConfig(n_requests=6, progress=False),
        warmup=LoadConfig(n_requests=4, progress=False),
        warmup_concurrency=4,
        # Three seed-mix requests (two of 4,096 prompt tokens), probes scaled down: ~10 s on 2 cores.
        offline=OfflineLoad(
            n_requests=3,
            warmup=1,
            probes=Probes(single_prompt_len=16, single_tokens=32, prefill_prompts=2, prefill_prompt_len=512),
        ),
    ),
}

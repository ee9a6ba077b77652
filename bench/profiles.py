"""How much load the perf tier and `bench ab` send: the `full`, `short` and `smoke` profiles.

tests/perf/conftest.py picks one with `--profile`; bench.ab measures each side of an A/B with one
(`short` by default). A profile with `sweep=None` runs no open-loop sweep (the A/B tests' own). A
profile says which sampling modes it measures (bench.trials.SAMPLING_MODES) and may run fewer cases
in the sampled one (`for_mode`): the CPU smoke keeps CI short that way.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from bench.offline import OfflineLoad, Probes
from bench.runner import LoadConfig, SweepConfig
from bench.trials import GREEDY, PREFIX_MODES, PROMPT_MODES, SAMPLING_MODES
from bench.workload import WorkloadSpec


@dataclass(frozen=True)
class PrefixShape:
    """The prefix-cache modes' requests (WorkloadSpec's fields of the same names): shared-prefix sends
    one of `num_prefixes` prefixes of `prefix_len` tokens, then `suffix_len` of its own; multi-turn
    starts each conversation with `prefix_len` tokens and adds a recorded reply and a user message of
    `suffix_len` each turn, for `turns` turns; each request generates `output_len` tokens. The
    default is the issue's target shape (16 prefixes of 2,048 tokens, suffixes and outputs of 128)."""

    num_prefixes: int = 16
    prefix_len: int = 2048
    suffix_len: int = 128
    output_len: int = 128
    turns: int = 6
    conversation_prefix_len: int = 1024  # multi-turn's first message: 1,024 + 5 x 256 + 128 fits 4,352


def prefix_workload(mode: str, shape: PrefixShape, concurrency: int, seed: int = 0) -> WorkloadSpec:
    """The workload of a prefix-cache mode at a concurrency (bench.trials.PREFIX_MODES), greedy token
    ids: multi-turn interleaves twice as many conversations as requests in flight, so a turn goes out
    after the one before it has usually finished (bench.workload.conversation_turn)."""
    kind = PREFIX_MODES[mode]["workload"]
    if kind == "seed-mix":
        return WorkloadSpec(kind="seed-mix", seed=seed)
    return WorkloadSpec(
        kind="multi-turn" if kind == "multi-turn" else "shared-prefix",
        seed=seed,
        output_len=shape.output_len,
        num_prefixes=shape.num_prefixes,
        prefix_len=shape.conversation_prefix_len if kind == "multi-turn" else shape.prefix_len,
        suffix_len=shape.suffix_len,
        turns=shape.turns,
        conversations=max(8, 2 * concurrency),
    )


def seed_mix(mode: str, seed: int = 0, tokenizer: str | None = None) -> WorkloadSpec:
    """The seed-mix workload in a mode: `seed_mix("sampled")` is `WorkloadSpec(kind="seed-mix", seed=0,
    **SAMPLED)`; a prompt mode (`text`, `chat`) is greedy and sends text made with `tokenizer`, the
    model folder."""
    if mode in PROMPT_MODES:
        chat = PROMPT_MODES[mode]["api"] == "chat"
        return WorkloadSpec(
            kind="seed-mix",
            seed=seed,
            prompt_format="text",
            api="chat" if chat else "completions",
            tokenizer=tokenizer,
        )
    settings = SAMPLING_MODES[mode]
    return WorkloadSpec(
        kind="seed-mix", seed=seed, temperature=settings["temperature"], top_p=settings["top_p"]
    )


@dataclass(frozen=True)
class Profile:
    """How much load each case sends. `full`: levels of at least 15 s (~750 requests at vLLM's H200
    capacity); the sweep stretches a level to 3x the p90 latency where the server last kept up, up to
    60 s, so a slow server's trial takes longer (vLLM: ~5 minutes a trial on an H200); `short`:
    capacity and two closed-loop levels of both targets in one command; `smoke` exercises the whole
    pipeline on CPU in a few minutes. `offline`: the offline case's run (all at once, then the two
    probes), before the target's server starts. `sampling`: the modes measured, each with every case,
    except that the sampled mode runs the sweep only if `sampled_sweep` and only the concurrencies
    `sampled_concurrencies` (None: all of them). `prompt_modes` (bench.trials.PROMPT_MODES: text,
    chat) run the closed loops only, at `prompt_concurrencies` (None: all of them): neither the sweep
    nor the offline case, which sends no HTTP; `bench ab` measures `sampling` alone. `prefix_modes`
    (bench.trials.PREFIX_MODES) run closed loops at `prefix_concurrencies` against each server with
    its prefix cache on, with requests of `prefix_shape`."""

    name: str
    sweep: SweepConfig | None
    sweep_load: LoadConfig
    concurrencies: tuple[int, ...]
    closed_load: LoadConfig
    warmup: LoadConfig
    warmup_concurrency: int
    offline: OfflineLoad
    sampling: tuple[str, ...] = (GREEDY,)
    sampled_sweep: bool = True
    sampled_concurrencies: tuple[int, ...] | None = None
    prompt_modes: tuple[str, ...] = ()
    prompt_concurrencies: tuple[int, ...] | None = None
    prefix_modes: tuple[str, ...] = ()
    prefix_concurrencies: tuple[int, ...] = ()
    prefix_shape: PrefixShape = PrefixShape()

    def __post_init__(self) -> None:
        if unknown := [mode for mode in self.sampling if mode not in SAMPLING_MODES]:
            raise ValueError(
                f"profile {self.name}: unknown sampling modes {unknown} ({sorted(SAMPLING_MODES)})"
            )
        if extra := set(self.sampled_concurrencies or ()) - set(self.concurrencies):
            raise ValueError(
                f"profile {self.name}: sampled concurrencies {sorted(extra)} not in {self.concurrencies}"
            )
        if unknown := [mode for mode in self.prompt_modes if mode not in PROMPT_MODES]:
            raise ValueError(f"profile {self.name}: unknown prompt modes {unknown} ({sorted(PROMPT_MODES)})")
        if unknown := [mode for mode in self.prefix_modes if mode not in PREFIX_MODES]:
            raise ValueError(f"profile {self.name}: unknown prefix modes {unknown} ({sorted(PREFIX_MODES)})")
        if self.prefix_modes and not self.prefix_concurrencies:
            raise ValueError(f"profile {self.name}: prefix modes without prefix_concurrencies")
        if extra := set(self.prompt_concurrencies or ()) - set(self.concurrencies):
            raise ValueError(
                f"profile {self.name}: prompt-mode concurrencies {sorted(extra)} not in {self.concurrencies}"
            )

    @property
    def modes(self) -> tuple[str, ...]:
        """Every mode the perf tier runs this profile's cases in: the sampling modes, then the prompt
        modes."""
        return (*self.sampling, *self.prompt_modes)

    def for_mode(self, mode: str) -> Profile:
        """The profile as `mode` runs it: greedy every case; sampled without the sweep unless
        `sampled_sweep`, and at `sampled_concurrencies` where given. The offline case runs in every
        mode the profile measures."""
        if mode == GREEDY:
            return self
        if mode in PREFIX_MODES:
            return dataclasses.replace(self, sweep=None, concurrencies=self.prefix_concurrencies)
        if mode in PROMPT_MODES:
            concurrencies = self.prompt_concurrencies
            return dataclasses.replace(
                self, sweep=None, concurrencies=self.concurrencies if concurrencies is None else concurrencies
            )
        return dataclasses.replace(
            self,
            sweep=self.sweep if self.sampled_sweep else None,
            concurrencies=self.concurrencies
            if self.sampled_concurrencies is None
            else self.sampled_concurrencies,
        )


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
        sampling=("greedy", "sampled"),
        # Sampled: the closed-loop levels and the offline case, no sweep. The sampler's cost shows in
        # every level's tokens/s; capacity is the scheduler's figure, judged greedy, and the sweep is
        # most of a trial's time (vLLM: ~3 of its ~5 minutes). The same in `short`.
        sampled_sweep=False,
        prompt_modes=("text", "chat"),
        # The targets: the shared-prefix workload at 64 in flight, both caches on; 8 for latency.
        prefix_modes=("shared-prefix", "multi-turn", "cache-on"),
        prefix_concurrencies=(8, 64),
    ),
    # Capacity and the closed loop at 1 and 128 of both targets in one 10-minute command (--target both),
    # greedy; sampled (`-k sampled`) the closed loops and the offline case, in about half that.
    "short": Profile(
        name="short",
        sweep=SweepConfig(start_rate=1.0, max_levels=8, latency_multiple=2.0, max_level_s=20.0),
        sweep_load=LoadConfig(duration_s=10.0, progress=False),
        concurrencies=(1, 128),
        closed_load=LoadConfig(duration_s=10.0, progress=False),
        warmup=LoadConfig(duration_s=8.0, progress=False),
        warmup_concurrency=32,
        offline=OfflineLoad(n_requests=300, warmup=16),
        sampling=("greedy", "sampled"),
        sampled_sweep=False,  # as in `full`
        prompt_modes=("text", "chat"),
        prefix_modes=("shared-prefix", "multi-turn", "cache-on"),
        prefix_concurrencies=(64,),
    ),
    "smoke": Profile(
        name="smoke",
        # Levels of 8 requests, stretched to 1x the latency but to no more than 6 s of arrivals: the
        # last level (4 req/s against a capacity of ~0.9) sends 24 requests, not the ~80 that the
        # latency at 2 req/s asked for, whose queue took ~90 of the sweep's 165 s on 2 cores (73 s
        # now). Its served rate is the capacity shown (0.99 req/s against the reference's 0.90), but
        # 24 requests are too few for the sweep to call it saturated: it reports capacity as still
        # rising. The smoke exercises the pipeline; test_sweep_slow_server.py tests the saturation.
        sweep=SweepConfig(start_rate=0.5, max_levels=4, latency_multiple=1.0, max_level_s=6.0),
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
        # Sampled too, but only the offline case and the closed loop at 4 in flight (no sweep): the
        # sampler's path end to end, over HTTP and in process, for little CI time (README, "Performance
        # tier", gives the smoke's time).
        sampling=("greedy", "sampled"),
        sampled_sweep=False,
        sampled_concurrencies=(4,),
        # Text prompts at 4 in flight: the server's tokenizer on the request path, for CI; chat adds
        # little on top of it (a template) and runs on the GPU profiles.
        prompt_modes=("text",),
        prompt_concurrencies=(4,),
    ),
}

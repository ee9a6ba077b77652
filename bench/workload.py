"""Workloads: what each request asks for, and when it arrives.

`make_request(spec, index)` builds request `index` of a workload deterministically from the seed, so
any worker process can build its own share; `arrival_offsets` gives the open-loop schedule.
The runner calls both; nothing here does I/O except reading a `--dataset` file.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np

SEED_MIX_PROMPT_LENS = (16, 64, 256, 1024, 4096)
SEED_MIX_OUTPUT_LENS = (64, 128, 256)
# The sampled variant of a workload: what a typical chat client sends (the OpenAI API's default
# temperature, a nucleus of 0.95).
SAMPLED = {"temperature": 1.0, "top_p": 0.95}

# Streams of the seed: request contents and arrival gaps draw from independent generators, so changing
# the rate never changes which prompts are sent.
_PROMPT_STREAM = 0
_ARRIVAL_STREAM = 1

WorkloadKind = Literal["seed-mix", "fixed", "jsonl"]
Arrival = Literal["constant", "poisson"]


@dataclass(frozen=True)
class WorkloadSpec:
    """Which prompts to send. `token_range` is half-open: ids in [low, high)."""

    kind: WorkloadKind = "seed-mix"
    seed: int = 0
    token_range: tuple[int, int] = (1000, 30000)
    input_len: int = 128  # fixed only
    output_len: int = 128  # fixed only
    dataset: str | None = None  # jsonl only
    # How every request of the workload samples: greedy (temperature 0) by default, as the stored
    # baselines were measured; SAMPLED is what a typical chat client sends.
    temperature: float = 0.0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        low, high = self.token_range
        if not 0 <= low < high:
            raise ValueError(f"token_range must satisfy 0 <= low < high, got {self.token_range}")
        if self.kind == "jsonl" and not self.dataset:
            raise ValueError("the jsonl workload needs a dataset file")
        if self.kind == "fixed" and (self.input_len < 1 or self.output_len < 1):
            raise ValueError("fixed workload needs input_len >= 1 and output_len >= 1")
        if not self.temperature >= 0:  # NaN fails too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def sampled(self) -> bool:
        return self.temperature > 0


@dataclass(frozen=True)
class Request:
    """One request of a workload. `prompt` is token ids (seed-mix, fixed) or text (jsonl)."""

    index: int
    prompt: list[int] | str
    prompt_len: int  # tokens for token-id prompts, whitespace words for text prompts
    max_tokens: int
    temperature: float = 0.0  # the workload's sampling (WorkloadSpec)
    top_p: float = 1.0


def make_request(spec: WorkloadSpec, index: int) -> Request:
    """Request number `index` of the workload; the same (spec, index) always gives the same request."""
    if spec.kind == "jsonl":
        entries = load_dataset(spec.dataset or "")
        prompt, max_tokens = entries[index % len(entries)]
        return Request(index, prompt, len(prompt.split()), max_tokens, spec.temperature, spec.top_p)
    rng = np.random.default_rng([spec.seed, _PROMPT_STREAM, index])
    if spec.kind == "seed-mix":
        prompt_len = int(rng.choice(SEED_MIX_PROMPT_LENS))
        max_tokens = int(rng.choice(SEED_MIX_OUTPUT_LENS))
    elif spec.kind == "fixed":
        prompt_len, max_tokens = spec.input_len, spec.output_len
    else:
        raise ValueError(f"unknown workload {spec.kind!r}")
    low, high = spec.token_range
    token_ids = rng.integers(low, high, size=prompt_len).tolist()
    return Request(index, token_ids, prompt_len, max_tokens, spec.temperature, spec.top_p)


def arrival_offsets(
    rate: float,
    *,
    n: int | None = None,
    duration_s: float | None = None,
    arrival: Arrival = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Open-loop arrival times in seconds from the level's start; the first arrival is at 0.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate (shape 1 is Poisson; below 1
    burstier, above 1 more regular); `constant` spaces them exactly 1/rate apart. The gaps for a seed
    are drawn once at unit rate and divided by `rate`, so two rates with one seed differ only in scale.
    Exactly one of `n` (that many arrivals) or `duration_s` (arrivals strictly before it) is given.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if (n is None) == (duration_s is None):
        raise ValueError("give exactly one of n or duration_s")
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])

    def unit_gaps(count: int) -> np.ndarray:
        if arrival == "constant":
            return np.ones(count)
        if arrival == "poisson":
            return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=count)
        raise ValueError(f"unknown arrival process {arrival!r}")

    if n is not None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        gaps = unit_gaps(max(n - 1, 0)) / rate
        return np.concatenate([[0.0], np.cumsum(gaps)])[:n].tolist()
    assert duration_s is not None
    offsets = [0.0]
    while True:  # draw in blocks so the sequence for a seed does not depend on the duration
        for gap in unit_gaps(1024) / rate:
            nxt = offsets[-1] + float(gap)
            if nxt >= duration_s:
                return offsets if duration_s > 0 else []
            offsets.append(nxt)


@lru_cache(maxsize=4)
def load_dataset(path: str) -> tuple[tuple[str, int], ...]:
    """Read (prompt text, max_tokens) pairs from a user's file.

    Two shapes are accepted, one JSON object per line or a single JSON array of them:
    `{"prompt": str, "max_tokens": int}`, or ShareGPT-style
    `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`, where the
    prompt is the first human turn and the budget the first gpt turn's length in whitespace words.
    Entries without a usable prompt or budget are skipped; an empty result is an error.
    """
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(stripped)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    entries = []
    for record in records:
        entry = _parse_record(record)
        if entry is not None:
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no usable entries (need prompt/max_tokens or ShareGPT conversations)")
    return tuple(entries)


def _parse_record(record: dict) -> tuple[str, int] | None:
    if "prompt" in record:
        prompt, max_tokens = record["prompt"], record.get("max_tokens")
    elif "conversations" in record:
        turns = record["conversations"]
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        reply = next((t["value"] for t in turns if t.get("from") == "gpt"), None)
        if human is None or reply is None:
            return None
        prompt, max_tokens = human, len(reply.split())
    else:
        return None
    if not isinstance(prompt, str) or not prompt or not isinstance(max_tokens, int) or max_tokens < 1:
        return None
    return prompt, max_tokens

"""Per-request generation settings, named and defaulted as in vLLM's SamplingParams.

The engine validates them once, when a request is added (`validate`), so that a bad value is
reported to the caller before anything is scheduled; the sampler and the stop checker only read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import InvalidRequestError

# Any signed or unsigned 64-bit integer (what torch.Generator took, before draws were keyed by the
# seed itself, mod 2^64: engine/sampler.py).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1


def choice_seed(seed: int, choice: int) -> int:
    """The seed of choice `choice` of a request that asks for several with `seed` (`n` > 1): seed +
    choice, as vLLM numbers them, taken mod 2^64 so that it stays a valid seed; draws are keyed by the
    seed mod 2^64 (engine/sampler.py), so choice 0 draws exactly as the request would alone."""
    return (seed + choice) % 2**64


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 means greedy. top_k of 0 or -1 disables top-k; top_p of 1.0 disables the nucleus;
    min_p of 0 disables min-p (keep tokens at least min_p times as likely as the most likely one).
    Penalties as vLLM's: repetition_penalty (1.0: off) over the prompt and the output, presence and
    frequency penalties (0: off) over the output. `seed` makes one request reproducible whatever else
    is in the batch (each token's draw is keyed by the seed and its position in the output).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stop_strings: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop_strings = (self.stop,)
        elif self.stop:
            self.stop_strings = tuple(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        """True when a penalty changes the logits: the sampler then keeps token counts for the sequence."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate(self) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise InvalidRequestError(
                f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens"
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN fails both
            raise InvalidRequestError(
                f"temperature must be a finite number >= 0, got {self.temperature}", "temperature"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise InvalidRequestError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k}", "top_k"
            )
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {value}", name)
        if not (_is_number(self.repetition_penalty) and 0.0 < self.repetition_penalty < math.inf):
            raise InvalidRequestError(
                f"repetition_penalty must be a finite number > 0 (1 is off), got {self.repetition_penalty}",
                "repetition_penalty",
            )
        if self.seed is not None and (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            # Checked here: a seed torch cannot take would otherwise fail the whole engine step.
            raise InvalidRequestError(
                f"seed must be an integer in [-2^63, 2^64 - 1], got {self.seed!r}", "seed"
            )
        if any(not isinstance(s, str) or not s for s in self.stop_strings):
            raise InvalidRequestError(
                "stop must be a non-empty string or a list of non-empty strings", "stop"
            )
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids or []):
            raise InvalidRequestError("stop_token_ids must be non-negative integers", "stop_token_ids")


def _is_number(value: object) -> bool:
    """An int or float, not a bool (NaN fails every range check by itself)."""
    return isinstance(value, int | float) and not isinstance(value, bool)

"""A request's state as the scheduler sees it: its tokens, how many have KV in the cache, its status.

Plain Python, no torch. A sequence moves WAITING -> RUNNING -> FINISHED, and back from RUNNING to
WAITING when preempted: its generated tokens are kept, its KV is dropped and recomputed later
(num_computed_tokens returns to 0, or to what the prefix cache still holds), so no token is lost or
produced twice. While a step is on the GPU its sampled token is a PLACEHOLDER at the end of
output_token_ids (num_pending counts them).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams

# An output token whose step is still on the GPU: the scheduler counts it (the next step decodes it)
# before its value is known; `Scheduler.commit` writes the value in.
PLACEHOLDER = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    seq_id: int  # arrival order: the scheduler's FCFS key and the allocator's table key
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float = 0.0
    # time.monotonic() when the scheduler first gave it a step (None while it waits): the request's
    # queue time ends here, its prefill begins (kept across preemption: the first time counts)
    first_scheduled_time: float | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None  # "stop", "length" or "abort"
    num_preemptions: int = 0
    num_pending: int = 0  # trailing output tokens still PLACEHOLDER (their step is in flight)
    # The prefix cache's hash of each full block of committed tokens so far (block_allocator.hash_block),
    # kept across preemption: the tokens do not change, and a resumed sequence looks itself up.
    block_hashes: list[bytes] = field(default_factory=list, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_slice(self, start: int, end: int) -> list[int]:
        """Tokens start..end-1 of prompt + output, without concatenating the whole sequence."""
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

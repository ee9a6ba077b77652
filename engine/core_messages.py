"""The messages between the engine core's process and the API processes, as msgspec structs.

Typed msgpack, not pickle: a message decodes only into these types, costs microseconds, and a step's
outputs for every request travel as one `StepOutputs` (arrays, not objects per token). Each API
process holds one DEALER socket to the core's ROUTER socket, so the core knows which process sent a
request and sends its outputs there alone.
"""

from __future__ import annotations

import msgspec

from engine.engine import EngineStats
from engine.sampling_params import SamplingParams


# -- API process -> core ------------------------------------------------------------------------
class AddRequest(msgspec.Struct, tag="add", array_like=True):
    """The validated engine requests of one HTTP request (several for a batch prompt), admitted all
    or none: their prompts are token ids, their parameters passed validation.

    `max_pending` is the server's admission limit, stated by the API process that sends it: the core
    sees every API process's requests, so it is where one limit over all of them can be held. Over
    it, each request fails with kind "overloaded" (a 503); admitted, `group_id` comes back in
    `StepOutputs.admitted`.
    """

    group_id: str
    request_ids: list[str]
    prompts: list[list[int]]
    params: SamplingParams
    arrival_time: float
    max_pending: int
    # Each request's own seed where they differ: the choices of one prompt (`n` > 1) with a seed, which
    # would otherwise draw alike; None: every request takes params.seed.
    seeds: list[int] | None = None


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    """End these requests (a disconnect, a stop string found by the API process, a drain)."""

    request_ids: list[str]


class ResetPrefixCache(msgspec.Struct, tag="reset_prefix_cache", array_like=True):
    """Forget the cached prefix blocks; the core answers with a `CallResult` of the same call_id."""

    call_id: int


class Hello(msgspec.Struct, tag="hello", array_like=True):
    """An API process's first message: the core sends it the stats at once, so its gauges start true."""


class Goodbye(msgspec.Struct, tag="goodbye", array_like=True):
    """The API process is going away: abort whatever it still has running."""


CoreRequest = AddRequest | AbortRequests | ResetPrefixCache | Hello | Goodbye


# -- core -> API process ------------------------------------------------------------------------
class CoreStats(msgspec.Struct, array_like=True):
    """The engine's gauges and counters after a core iteration, and its preemptions so far."""

    engine: EngineStats
    num_preemptions: int
    num_pending: int  # requests admitted and not finished, from every API process


class FirstTokenTimes(msgspec.Struct, array_like=True):
    """Where a request's time to its first token went inside the core, as time.monotonic() readings
    (one clock for every process of the host, so the API process subtracts its own arrival time):
    the core took the request, the scheduler first gave it a step, the core sent the first token."""

    received: float
    scheduled: float
    sent: float

    def parts(self, arrival: float, taken: float) -> tuple[float, float, float, float]:
        """The time from `arrival` (the API process handing the request over) to `taken` (it taking
        the first token) in four parts that add up to it: to the core, queued, prefill, delivery."""
        return (
            self.received - arrival,
            self.scheduled - self.received,
            self.sent - self.scheduled,
            taken - self.sent,
        )


class TokenDelta(msgspec.Struct, array_like=True):
    """One request's new tokens in a step; finish_reason is set on its last delta, first_token_times
    on its first (the queue and prefill histograms of /metrics come from them)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    first_token_times: FirstTokenTimes | None = None


def over_the_limit(pending: int, max_pending: int) -> str:
    """The refusal of a request over the admission limit, whichever side finds it: the API process
    (its own requests alone) or the core (every API process's)."""
    return f"too many pending requests ({pending} accepted, at most {max_pending}); retry later"


class RequestFailed(msgspec.Struct, array_like=True):
    """A request the core refused (`invalid`: the caller's fault, a 400; `overloaded`: over the
    admission limit, a 503) or lost (`engine`: a 500)."""

    request_id: str
    kind: str  # "invalid", "overloaded" or "engine"
    message: str
    param: str | None = None


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    """Everything one API process hears after a core iteration: the groups (`AddRequest.group_id`)
    it admitted, the requests' new tokens and failures, and the stats. step_seconds is None when the
    core did not step (it only took messages, e.g. aborts, whose effect the stats show)."""

    admitted: list[str]
    deltas: list[TokenDelta]
    failures: list[RequestFailed]
    stats: CoreStats
    step_seconds: float | None = None


class CallResult(msgspec.Struct, tag="result", array_like=True):
    call_id: int
    value: int
    stats: CoreStats
    error: str | None = None


CoreOutput = StepOutputs | CallResult


class CoreInfo(msgspec.Struct):
    """What the core tells its launcher once it is ready: enough for an API process to validate,
    tokenize and describe the model without loading it."""

    model: str
    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    device: str  # "cuda:0", "cpu"
    gpu_name: str | None
    config: dict[str, object]
    stats: CoreStats


REQUEST_ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODER = msgspec.msgpack.Decoder(CoreRequest)
OUTPUT_DECODER = msgspec.msgpack.Decoder(CoreOutput)

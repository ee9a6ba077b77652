"""From new token ids to what a caller reads: text, stop strings, `RequestOutput`s.

One implementation serves both places that turn tokens into outputs: `LLMEngine` (the offline API
and the engine core's own outputs) and the server's API processes, which receive bare token ids from
the engine core and do the text work there, off the core's step loop. A stop string ends a request
here, not in the scheduler: the caller sees `ended_by_text` and ends the request in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams


@dataclass
class RequestOutput:
    """A request's progress after a step: the delta since the last output and the totals so far."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    text: str
    new_text: str
    finished: bool
    finish_reason: str | None = None  # "stop", "length" or "abort"
    # On a request's first output only: time.monotonic() when the scheduler first gave it a step.
    first_scheduled_time: float | None = None
    # The request's output list (append-only) and how much of it this output covers: the full list is
    # copied only when read, so a streaming consumer pays per new token, not per token so far.
    _output_ref: list[int] = field(default_factory=list, repr=False)
    _num_output_tokens: int = 0

    @property
    def token_ids(self) -> list[int]:
        """All tokens generated so far."""
        return self._output_ref[: self._num_output_tokens]

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and a later one of the same request as one: both deltas, the later totals."""
        if later.request_id != self.request_id:
            raise ValueError(f"outputs of {self.request_id} and {later.request_id} are not one request's")
        return RequestOutput(
            request_id=later.request_id,
            prompt_token_ids=later.prompt_token_ids,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            text=later.text,
            new_text=self.new_text + later.new_text,
            finished=later.finished,
            finish_reason=later.finish_reason,
            first_scheduled_time=self.first_scheduled_time,
            _output_ref=later._output_ref,
            _num_output_tokens=later._num_output_tokens,
        )

    @classmethod
    def aborted(cls, request_id: str) -> RequestOutput:
        """The last output of a request ended by its caller."""
        return cls(request_id, [], [], "", "", finished=True, finish_reason="abort")


@dataclass
class _Tracked:
    prompt_token_ids: list[int]
    detokenizer: IncrementalDetokenizer | None  # None: token ids only, no text
    token_ids: list[int]  # every output token so far (the detokenizer's own list when it has one)
    num_sent_chars: int = 0


class OutputProcessor:
    """The per-request text state of every unfinished request, and the outputs built from it.

    With `detokenize=False` (an engine core whose API processes do the text) outputs carry token
    ids only and stop strings are not looked for.
    """

    def __init__(self, tokenizer: Any, detokenize: bool = True) -> None:
        self.tokenizer = tokenizer
        self.detokenize = detokenize
        self._requests: dict[str, _Tracked] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop_strings) if self.detokenize else None
        token_ids = detokenizer.token_ids if detokenizer is not None else []
        self._requests[request_id] = _Tracked(prompt_token_ids, detokenizer, token_ids)

    def discard(self, request_id: str) -> None:
        """Forget a request (aborted); unknown ids are ignored."""
        self._requests.pop(request_id, None)

    def process(self, request_id: str, new_token_ids: list[int], finish_reason: str | None) -> RequestOutput:
        """The output for a request's new tokens; `finish_reason` is the engine's (None: still running).

        A stop string found in the new text finishes the output with reason "stop" even when the
        engine has not finished the request: see `ended_by_text`. A finished request is forgotten.
        """
        tracked = self._requests[request_id]
        detokenizer = tracked.detokenizer
        finished = finish_reason is not None
        if detokenizer is None:
            tracked.token_ids.extend(new_token_ids)
            text = new_text = ""
        else:
            detokenizer.append(new_token_ids, final=finished)
            if detokenizer.stopped:
                finished, finish_reason = True, "stop"
            text = detokenizer.visible_text(finished)
            new_text = text[tracked.num_sent_chars :]
            tracked.num_sent_chars = len(text)
        if finished:
            del self._requests[request_id]
        return RequestOutput(
            request_id=request_id,
            prompt_token_ids=tracked.prompt_token_ids,
            new_token_ids=new_token_ids,
            text=text,
            new_text=new_text,
            finished=finished,
            finish_reason=finish_reason,
            _output_ref=tracked.token_ids,
            _num_output_tokens=len(tracked.token_ids),
        )


def ended_by_text(output: RequestOutput, engine_finish_reason: str | None) -> bool:
    """True when the output processor ended a request the engine still runs (a stop string)."""
    return output.finished and engine_finish_reason is None

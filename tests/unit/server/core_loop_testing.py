"""Helpers of the engine core's loop tests: the loop (engine.core_process.EngineCore) run in a thread
over a stand-in engine, and an API process's side of its socket.

Imported by test_core_queue.py and test_core_arrival_wait.py (pytest puts this folder on sys.path).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from engine.core_messages import REQUEST_ENCODER, AddRequest, Hello
from engine.core_process import ArrivalWait, EngineCore, without_high_water_marks
from engine.engine import EngineStats
from engine.sampling_params import SamplingParams


@dataclass
class StepOutput:
    """What EngineCore reads of a RequestOutput."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    first_scheduled_time: float | None = None  # on a request's first output only


class StandInScheduler:
    """What EngineCore reads of the engine's scheduler."""

    num_preemptions = 0


class OneTokenAStepEngine:
    """What EngineCore uses of LLMEngine: each step gives every request one token (7), and a request
    ends after its max_tokens."""

    def __init__(self) -> None:
        self.scheduler = StandInScheduler()
        self.remaining: dict[str, int] = {}
        self.started: set[str] = set()  # requests that had their first output

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float) -> None:
        self.remaining[request_id] = params.max_tokens

    def abort(self, request_id: str) -> None:
        self.remaining.pop(request_id, None)

    def step(self) -> list[StepOutput]:
        outputs = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            last = self.remaining[request_id] == 0
            if last:
                del self.remaining[request_id]
            first = request_id not in self.started
            self.started.add(request_id)
            scheduled = time.monotonic() if first else None
            outputs.append(StepOutput(request_id, [7], last, "length" if last else None, scheduled))
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.remaining), 0, 0, 16)


@contextmanager
def core_loop(engine: Any, folder: Path, arrival_wait: ArrivalWait = ArrivalWait()) -> Iterator[zmq.Socket]:
    """EngineCore's loop over `engine` in a thread, on a socket in `folder`; yields an API process's
    DEALER socket, connected and introduced. On exit the lifeline closes, the loop must end, and
    everything is closed."""
    address = f"ipc://{folder}/core.sock"
    context = zmq.Context()
    router = without_high_water_marks(context.socket(zmq.ROUTER), linger_ms=0)
    router.bind(address)
    lifeline_read, lifeline_write = os.pipe()
    core = EngineCore(engine, router, lifeline_read, arrival_wait)
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    dealer = without_high_water_marks(context.socket(zmq.DEALER), linger_ms=0)
    dealer.connect(address)
    try:
        dealer.send(REQUEST_ENCODER.encode(Hello()))
        yield dealer
    finally:
        os.close(lifeline_write)  # the core's loop ends when its lifeline closes
        loop.join(10)
        os.close(lifeline_read)
        dealer.close()
        router.close()
        context.term()
    assert not loop.is_alive(), "the core's loop did not end with its lifeline"


def send_request(dealer: zmq.Socket, request_id: str, max_tokens: int) -> None:
    """One request of a two-token prompt, generating max_tokens tokens whatever they are."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    dealer.send(REQUEST_ENCODER.encode(AddRequest(request_id, [request_id], [[1, 2]], params, 0.0, 8)))

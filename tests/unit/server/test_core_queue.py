"""The core's connection loses nothing when an API process lags: the engine core's loop (in a
thread, over a stand-in engine that emits one token a step) runs thousands of steps while its API
process reads nothing, then every token delta must still be there. Under ZeroMQ's default high-water
marks a ROUTER drops what it cannot queue, silently; this test fails there."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import zmq

from engine.core_messages import OUTPUT_DECODER, REQUEST_ENCODER, AddRequest, Hello, StepOutputs
from engine.core_process import EngineCore, without_high_water_marks
from engine.engine import EngineStats
from engine.sampling_params import SamplingParams

STEPS = 5_000  # well past ZeroMQ's default marks (1,000 queued at each end)


@dataclass
class _Output:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None


class _Scheduler:
    num_preemptions = 0


class TokenPerStepEngine:
    """What EngineCore uses of LLMEngine: one token a step for each request, STEPS steps long."""

    def __init__(self) -> None:
        self.scheduler = _Scheduler()
        self.remaining: dict[str, int] = {}
        self.done = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float) -> None:
        self.remaining[request_id] = STEPS

    def abort(self, request_id: str) -> None:
        self.remaining.pop(request_id, None)

    def step(self) -> list[_Output]:
        outputs = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            last = self.remaining[request_id] == 0
            if last:
                del self.remaining[request_id]
            outputs.append(_Output(request_id, [7], last, "length" if last else None))
        if not self.remaining:
            self.done.set()
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.remaining), 0, 0, 16)


def test_a_lagging_api_process_loses_no_token_delta(tmp_path) -> None:
    address = f"ipc://{tmp_path}/core.sock"
    context = zmq.Context()
    router = without_high_water_marks(context.socket(zmq.ROUTER), linger_ms=0)
    router.bind(address)
    lifeline_read, lifeline_write = os.pipe()
    engine = TokenPerStepEngine()
    core = EngineCore(engine, router, lifeline_read)  # type: ignore[arg-type]
    loop = threading.Thread(target=core.run, daemon=True)
    loop.start()
    dealer = without_high_water_marks(context.socket(zmq.DEALER), linger_ms=0)
    dealer.connect(address)
    try:
        dealer.send(REQUEST_ENCODER.encode(Hello()))
        params = SamplingParams(max_tokens=STEPS, ignore_eos=True)
        dealer.send(REQUEST_ENCODER.encode(AddRequest("r", ["r"], [[1, 2]], params, 0.0, 8)))
        assert engine.done.wait(60), "the stand-in engine did not finish its steps"
        tokens, finish = 0, None
        while dealer.poll(2_000):  # everything the core sent is queued by now; read it all
            message = OUTPUT_DECODER.decode(dealer.recv())
            assert isinstance(message, StepOutputs)
            for delta in message.deltas:
                tokens += len(delta.new_token_ids)
                finish = delta.finish_reason or finish
        assert (tokens, finish) == (STEPS, "length")
    finally:
        os.close(lifeline_write)  # the core's loop ends when its lifeline closes
        loop.join(10)
        os.close(lifeline_read)
        dealer.close()
        router.close()
        context.term()
    assert not loop.is_alive()

"""The core's connection loses nothing when an API process lags: the engine core's loop (in a
thread, over a stand-in engine that emits one token a step) runs thousands of steps while its API
process reads nothing, then every token delta must still be there. Under ZeroMQ's default high-water
marks a ROUTER drops what it cannot queue, silently; this test fails there."""

from __future__ import annotations

import threading

from core_loop_testing import StandInScheduler, StepOutput, core_loop, send_request

from engine.core_messages import OUTPUT_DECODER, StepOutputs
from engine.engine import EngineStats
from engine.sampling_params import SamplingParams

STEPS = 5_000  # well past ZeroMQ's default marks (1,000 queued at each end)


class TokenPerStepEngine:
    """What EngineCore uses of LLMEngine: one token a step for each request, STEPS steps long."""

    def __init__(self) -> None:
        self.scheduler = StandInScheduler()
        self.remaining: dict[str, int] = {}
        self.done = threading.Event()

    def has_unfinished_requests(self) -> bool:
        return bool(self.remaining)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float) -> None:
        self.remaining[request_id] = STEPS

    def abort(self, request_id: str) -> None:
        self.remaining.pop(request_id, None)

    def step(self) -> list[StepOutput]:
        outputs = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            last = self.remaining[request_id] == 0
            if last:
                del self.remaining[request_id]
            outputs.append(StepOutput(request_id, [7], last, "length" if last else None))
        if not self.remaining:
            self.done.set()
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(len(self.remaining), 0, 0, 16)


def test_a_lagging_api_process_loses_no_token_delta(tmp_path) -> None:
    engine = TokenPerStepEngine()
    with core_loop(engine, tmp_path) as dealer:
        send_request(dealer, "r", STEPS)
        assert engine.done.wait(60), "the stand-in engine did not finish its steps"
        tokens, finish = 0, None
        while dealer.poll(2_000):  # everything the core sent is queued by now; read it all
            message = OUTPUT_DECODER.decode(dealer.recv())
            assert isinstance(message, StepOutputs)
            for delta in message.deltas:
                tokens += len(delta.new_token_ids)
                finish = delta.finish_reason or finish
        assert (tokens, finish) == (STEPS, "length")

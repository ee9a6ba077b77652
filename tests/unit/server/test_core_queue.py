"""The core's connection loses nothing when an API process lags: the engine core's loop (in a
thread, over a stand-in engine that emits one token a step) runs thousands of steps while its API
process reads nothing, then every token delta must still be there. Under ZeroMQ's default high-water
marks a ROUTER drops what it cannot queue, silently; this test fails there."""

from __future__ import annotations

import threading

from core_loop_testing import OneTokenAStepEngine, StepOutput, core_loop, send_request

from engine.core_messages import OUTPUT_DECODER, StepOutputs

STEPS = 5_000  # well past ZeroMQ's default marks (1,000 queued at each end)


class TokenPerStepEngine(OneTokenAStepEngine):
    """The stand-in engine, telling when it has no request left."""

    def __init__(self) -> None:
        super().__init__()
        self.done = threading.Event()

    def step(self) -> list[StepOutput]:
        outputs = super().step()
        if not self.remaining:
            self.done.set()
        return outputs


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

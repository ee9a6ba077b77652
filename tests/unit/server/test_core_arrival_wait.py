"""The engine core's wait for the next requests of clients whose requests just finished
(engine.core_process.ArrivalWait): its loop (in a thread) over a stand-in engine whose steps take
STEP_S on a pretend device, and a client that sends a new request shortly after it reads that its last
one finished, as a closed loop does. With the wait, the new request reaches the engine before the
step after the finishing one is scheduled; without it (or once the device has nothing in flight) the
core schedules that step at once and the request waits for the next."""

from __future__ import annotations

import time

import pytest
from core_loop_testing import OneTokenAStepEngine, StepOutput, core_loop, send_request

from engine.core_messages import OUTPUT_DECODER, StepOutputs
from engine.core_process import ArrivalWait
from engine.sampling_params import SamplingParams

STEP_S = 0.4  # long beside a client's turnaround, even on a loaded CI machine
# The client's turnaround: well inside the wait's budget (0.5 x STEP_S here) and far longer than the
# core's own path from sending a step's outputs to scheduling the next step, so which side of that
# step the replacement lands on is decided by the wait alone, not by which thread the machine runs
# first (a client answering at once could beat a core that does not wait).
CLIENT_TURNAROUND_S = 0.05


class PretendDeviceEngine(OneTokenAStepEngine):
    """The stand-in engine on a pretend device: each `step()` leaves the next step running there for
    STEP_S, and the following call waits for it. `added_at` records, for each request, how many steps
    had been taken when it arrived."""

    def __init__(self, device_busy: bool = True) -> None:
        super().__init__()
        self.added_at: dict[str, int] = {}
        self.steps = 0
        self.device_busy = device_busy
        self._in_flight_until = 0.0

    def is_step_running(self) -> bool:
        return self.device_busy and time.perf_counter() < self._in_flight_until

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, arrival: float) -> None:
        super().add_request(request_id, prompt, params, arrival)
        self.added_at[request_id] = self.steps

    def step(self) -> list[StepOutput]:
        time.sleep(max(0.0, self._in_flight_until - time.perf_counter()))
        self.steps += 1
        outputs = super().step()
        self._in_flight_until = time.perf_counter() + STEP_S
        return outputs


def _replace_a_finished_request(engine: PretendDeviceEngine, wait: ArrivalWait, tmp_path) -> int:
    """A long request keeps the engine busy; a short one finishes after 3 steps (the core's budget
    comes from the last two steps' times, and the first took no time: nothing was in flight) and the
    client sends its replacement CLIENT_TURNAROUND_S after it reads the finish. Returns the steps taken
    after the finishing step before the replacement reached the engine (0: in time for the next step)."""
    with core_loop(engine, tmp_path, wait) as dealer:
        send_request(dealer, "long", 8)
        send_request(dealer, "short", 3)
        finished_after = None
        while finished_after is None:
            assert dealer.poll(30_000), "the core sent nothing"
            message = OUTPUT_DECODER.decode(dealer.recv())
            assert isinstance(message, StepOutputs)
            if any(d.request_id == "short" and d.finish_reason for d in message.deltas):
                finished_after = engine.steps
                time.sleep(CLIENT_TURNAROUND_S)
                send_request(dealer, "next", 2)  # soon after, as a closed-loop client does
        deadline = time.monotonic() + 30
        while "next" not in engine.added_at and time.monotonic() < deadline:
            time.sleep(0.01)
        return engine.added_at["next"] - finished_after


def test_the_next_request_of_a_finished_client_makes_the_next_step(tmp_path) -> None:
    engine = PretendDeviceEngine()
    assert _replace_a_finished_request(engine, ArrivalWait(max_ms=1000, fraction=0.5), tmp_path) == 0


def test_without_the_wait_the_next_request_waits_a_step(tmp_path) -> None:
    engine = PretendDeviceEngine()
    assert _replace_a_finished_request(engine, ArrivalWait(max_ms=0), tmp_path) == 1


def test_the_core_does_not_wait_while_the_device_has_nothing_to_run(tmp_path) -> None:
    engine = PretendDeviceEngine(device_busy=False)
    assert _replace_a_finished_request(engine, ArrivalWait(max_ms=1000, fraction=0.5), tmp_path) == 1


def test_an_arrival_wait_refuses_nonsense_and_keeps_to_its_fraction() -> None:
    with pytest.raises(ValueError, match="max_ms >= 0"):
        ArrivalWait(max_ms=-1)
    with pytest.raises(ValueError, match="fraction"):
        ArrivalWait(max_ms=3, fraction=1.5)
    wait = ArrivalWait(max_ms=3, fraction=0.3)
    assert wait.budget_s(0.005) == pytest.approx(0.0015)
    assert wait.budget_s(0.050) == pytest.approx(0.003)
    assert ArrivalWait().budget_s(1.0) == 0.0

"""The scheduler with a tiny fake cache and fake model outputs: exact counts and block ids, then properties.

The fake model returns, for each sequence that samples, a token that encodes which output position it
was computed for (`start + num_tokens`), so a token produced twice or skipped after a preemption
shows up as a wrong value, not just a wrong count.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import assume, given, settings

from engine.block_allocator import BlockAllocator
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence, SequenceStatus

EOS = 2


def make(num_blocks=8, block_size=4, budget=8, max_seqs=4, max_model_len=64) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_seqs, budget, max_model_len),
        BlockAllocator(num_blocks, block_size),
        eos_token_ids=(EOS,),
    )


def seq(seq_id: int, prompt_len: int, max_tokens: int = 4, **params) -> Sequence:
    prompt = [100 + seq_id * 1000 + i for i in range(prompt_len)]
    return Sequence(
        seq_id,
        f"r{seq_id}",
        prompt,
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params),
    )


def fake_tokens(out: SchedulerOutput) -> list[int]:
    """Token = 10_000 x seq_id + the output index it was sampled for."""
    return [
        10_000 * (s.seq.seq_id + 1) + (s.start + s.num_tokens - s.seq.num_prompt_tokens)
        for s in out.scheduled
        if s.samples
    ]


def test_chunked_prefill_worked_example():
    scheduler = make(budget=8)
    a, b = seq(0, 6), seq(1, 5)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.start, s.num_tokens, s.samples) for s in out.scheduled] == [
        (0, 0, 6, True),
        (1, 0, 2, False),
    ]
    assert scheduler.allocator.block_table(0) == [0, 1]
    assert scheduler.allocator.block_table(1) == [2]
    scheduler.update(out, fake_tokens(out))
    assert a.output_token_ids == [10_000]
    out = scheduler.schedule()
    # The decode goes first; the rest of B's prompt fills the budget's remainder.
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in out.scheduled] == [(0, 6, 1), (1, 2, 3)]
    assert scheduler.allocator.block_table(1) == [2, 3]
    scheduler.update(out, fake_tokens(out))
    assert b.output_token_ids == [20_000]


def test_long_prompt_does_not_stall_decodes():
    scheduler = make(num_blocks=64, budget=8)
    short, long_ = seq(0, 2, max_tokens=10), seq(1, 40, max_tokens=2)
    scheduler.add(short)
    out = scheduler.schedule()
    scheduler.update(out, fake_tokens(out))
    scheduler.add(long_)
    for _ in range(4):
        out = scheduler.schedule()
        ids = [(s.seq.seq_id, s.num_tokens) for s in out.scheduled]
        assert ids[0] == (0, 1)  # the decode runs every step
        assert ids[1] == (1, 7)  # the prompt takes the rest, a chunk at a time
        scheduler.update(out, fake_tokens(out))


def test_preempts_newest_and_recomputes_without_losing_tokens():
    scheduler = make(num_blocks=4, block_size=4, budget=16)
    a, b = seq(0, 7, max_tokens=6), seq(1, 7, max_tokens=6)
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()  # both prompts: 2 blocks each, cache full
    assert scheduler.allocator.num_free_blocks == 0
    scheduler.update(out, fake_tokens(out))
    out = scheduler.schedule()  # both reach 8 tokens: still fits
    scheduler.update(out, fake_tokens(out))
    out = scheduler.schedule()  # A needs a third block: B, the newest, is preempted
    assert out.preempted == [b]
    assert b.status is SequenceStatus.WAITING and b.num_computed_tokens == 0
    assert b.output_token_ids == [20_000, 20_001]  # kept for recompute
    assert [s.seq for s in out.scheduled] == [a]
    scheduler.update(out, fake_tokens(out))
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, fake_tokens(out))
    assert a.output_token_ids == [10_000 + i for i in range(6)]
    assert b.output_token_ids == [20_000 + i for i in range(6)]
    assert scheduler.allocator.num_free_blocks == 4


def test_stops_on_eos_unless_ignored_and_on_stop_token_ids():
    scheduler = make()
    plain = Sequence(0, "r0", [5, 6], SamplingParams(max_tokens=8, temperature=0.0))
    ignoring = Sequence(1, "r1", [5, 6], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    stopping = Sequence(2, "r2", [5, 6], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[77]))
    for s in (plain, ignoring, stopping):
        scheduler.add(s)
    out = scheduler.schedule()
    finished = scheduler.update(out, [EOS, EOS, 77])
    assert finished == [plain, stopping]
    assert plain.finish_reason == "stop" and stopping.finish_reason == "stop"
    assert ignoring.status is SequenceStatus.RUNNING


def test_abort_waiting_and_running_frees_blocks():
    scheduler = make(max_seqs=1)
    a, b = seq(0, 5), seq(1, 5)
    scheduler.add(a)
    scheduler.add(b)
    scheduler.schedule()
    assert scheduler.abort("r1") is b  # still waiting
    assert scheduler.abort("r0") is a  # running, mid-step
    assert a.finish_reason == "abort"
    assert scheduler.allocator.num_free_blocks == 8
    assert not scheduler.has_unfinished()
    assert scheduler.abort("r0") is None


@dataclass
class Request:
    prompt_len: int
    max_tokens: int
    arrive_step: int
    abort_step: int | None


requests_strategy = st.lists(
    st.builds(
        Request,
        st.integers(1, 40),
        st.integers(1, 12),
        st.integers(0, 6),
        st.one_of(st.none(), st.integers(0, 30)),
    ),
    min_size=1,
    max_size=10,
)


@settings(max_examples=200, deadline=None)
@given(
    requests=requests_strategy,
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(4, 40),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 6),
)
def test_scheduler_properties(requests, block_size, num_blocks, budget, max_seqs):
    max_seqs = min(max_seqs, budget)
    capacity = num_blocks * block_size
    # The engine refuses what cannot fit alone; seq ids follow arrival order, as the engine assigns them.
    requests = sorted(
        (r for r in requests if r.prompt_len + r.max_tokens <= capacity), key=lambda r: r.arrive_step
    )
    assume(requests)
    scheduler = make(num_blocks, block_size, budget, max_seqs, max_model_len=capacity)
    seqs = [seq(i, r.prompt_len, r.max_tokens) for i, r in enumerate(requests)]
    computed = {s.seq_id: 0 for s in seqs}  # tokens whose KV the fake model holds
    first_scheduled: list[int] = []
    aborted: set[int] = set()
    for step in range(2000):
        for s, r in zip(seqs, requests, strict=True):
            if r.arrive_step == step:
                scheduler.add(s)
            if r.abort_step == step and r.arrive_step <= step and not s.is_finished:
                scheduler.abort(s.request_id)
                aborted.add(s.seq_id)
                assert scheduler.allocator.block_table(s.seq_id) == []
        if step > max(r.arrive_step for r in requests) and not scheduler.has_unfinished():
            break
        out = scheduler.schedule()
        for victim in out.preempted:
            computed[victim.seq_id] = 0
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_seqs and scheduler.num_running <= max_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        for item in out.scheduled:
            assert item.start == computed[item.seq.seq_id]  # recompute starts where the cache is
            assert (
                len(scheduler.allocator.block_table(item.seq.seq_id)) * block_size
                >= item.start + item.num_tokens
            )
            computed[item.seq.seq_id] += item.num_tokens
            if item.seq.seq_id not in first_scheduled:
                first_scheduled.append(item.seq.seq_id)
        scheduler.allocator.check_integrity()
        scheduler.update(out, fake_tokens(out))
    else:
        raise AssertionError("requests did not finish: the scheduler stalled")
    assert first_scheduled == sorted(first_scheduled)  # first come, first served
    for s in seqs:
        if s.seq_id in aborted:
            assert s.finish_reason == "abort"
        else:  # ignore_eos: exactly max_tokens, each output index once, in order
            assert s.output_token_ids == [10_000 * (s.seq_id + 1) + i for i in range(s.params.max_tokens)]
            assert s.finish_reason == "length"
    assert scheduler.allocator.num_free_blocks == num_blocks

"""The scheduler with a tiny fake cache and fake model outputs: exact counts and block ids, then properties.

The fake model returns, for each sequence that samples, a token that encodes which output position it
was computed for (`start + num_tokens`), so a token produced twice or skipped after a preemption
shows up as a wrong value, not just a wrong count. The property test also keeps a fake KV cache (which
sequence's token at which position each slot holds), so a prefix-cache hit that reads the wrong KV, or
a write into a block another sequence shares, is caught.
"""

from __future__ import annotations

from dataclasses import dataclass

import hypothesis.strategies as st
from hypothesis import assume, given, settings

from engine.block_allocator import BlockAllocator, hash_block
from engine.config import SchedulerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus

EOS = 2


def make(
    num_blocks=8, block_size=4, budget=8, max_seqs=4, max_model_len=64, prefix_caching=True
) -> Scheduler:
    return Scheduler(
        SchedulerConfig(max_seqs, budget, max_model_len, enable_prefix_caching=prefix_caching),
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
    assert scheduler.allocator.num_used_blocks == 0
    scheduler.allocator.check_integrity()


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
    assert scheduler.allocator.num_used_blocks == 0
    assert not scheduler.has_unfinished()
    assert scheduler.abort("r0") is None


def prompt_seq(seq_id: int, prompt: list[int], max_tokens: int = 4) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence(seq_id, f"r{seq_id}", prompt, params)


def chain(tokens: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of the full blocks of tokens."""
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start : start + block_size]))
    return hashes


def run_to_end(scheduler: Scheduler) -> None:
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        scheduler.update(out, fake_tokens(out))


def test_prefix_cache_worked_example():
    """The module docstring's example: block size 4, budget 8."""
    scheduler = make(num_blocks=8, block_size=4, budget=8)
    prompt = list(range(500, 510))
    a = prompt_seq(0, prompt)
    scheduler.add(a)
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in out.scheduled] == [(0, 0, 8)]
    scheduler.update(out, fake_tokens(out))  # tokens 0-7 computed: blocks 0 and 1 registered
    b = prompt_seq(1, prompt[:8] + [900, 901, 902])
    scheduler.add(b)
    out = scheduler.schedule()
    # A's last 2 prompt tokens; B starts after the 8 tokens it found cached and computes 3, not 11.
    assert [(s.seq.seq_id, s.start, s.num_tokens, s.samples) for s in out.scheduled] == [
        (0, 8, 2, True),
        (1, 8, 3, True),
    ]
    assert scheduler.allocator.block_table(0) == [0, 1, 2]
    assert scheduler.allocator.block_table(1) == [0, 1, 3]  # shared, then its own
    assert b.num_computed_tokens == 8
    scheduler.update(out, fake_tokens(out))
    c = prompt_seq(2, prompt[:8])  # wholly cached: (8 - 1) // 4 = 1 block taken, tokens 4-7 computed
    scheduler.add(c)
    out = scheduler.schedule()
    assert [(s.seq.seq_id, s.start, s.num_tokens) for s in out.scheduled] == [
        (0, 10, 1),
        (1, 11, 1),
        (2, 4, 4),
    ]
    assert scheduler.allocator.block_table(2) == [0, 4]
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (10 + 11 + 8, 0 + 8 + 4)
    scheduler.update(out, fake_tokens(out))
    run_to_end(scheduler)
    assert [s.output_token_ids for s in (a, b, c)] == [
        [10_000 * (i + 1) + k for k in range(4)] for i in range(3)
    ]
    allocator = scheduler.allocator
    assert allocator.num_used_blocks == 0
    # Cached: A's and B's prompt blocks 0-1 (shared), A's block of tokens 8-11 (prompt 8-9 and its
    # first two outputs, all computed), B's of 8-11 (3 prompt tokens and its first output); C's second
    # block held the same tokens as block 1, so it was not registered twice and is free.
    assert allocator.num_cached_blocks == 4
    allocator.check_integrity()


def test_without_prefix_caching_nothing_is_shared_or_kept():
    scheduler = make(num_blocks=8, block_size=4, budget=16, prefix_caching=False)
    prompt = list(range(500, 510))
    scheduler.add(prompt_seq(0, prompt))
    run_to_end(scheduler)
    scheduler.add(prompt_seq(1, prompt))
    out = scheduler.schedule()
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(0, 10)]
    scheduler.update(out, fake_tokens(out))
    run_to_end(scheduler)
    assert scheduler.allocator.num_free_blocks == 8 and scheduler.allocator.num_cached_blocks == 0
    assert (scheduler.prefix_cache_queries, scheduler.prefix_cache_hits) == (0, 0)


def test_a_generated_block_is_registered_only_once_its_last_token_is_committed():
    """Async steps: step N+1 is scheduled and advanced before step N's token is committed. A block
    whose last token is that PLACEHOLDER is computed but not yet known, so not yet registered."""
    scheduler = make(num_blocks=8, block_size=4, budget=8)
    a = prompt_seq(0, [500, 501, 502], max_tokens=6)
    scheduler.add(a)
    first = scheduler.schedule()
    scheduler.advance(first)  # prompt computed; output 0 pending
    second = scheduler.schedule()  # the decode of output 0, whose value is on the "GPU"
    assert [(s.start, s.num_tokens) for s in second.scheduled] == [(3, 1)]
    scheduler.advance(second)  # tokens 0-3 computed, token 3 still a PLACEHOLDER
    assert a.num_computed_tokens == 4 and a.output_token_ids == [PLACEHOLDER, PLACEHOLDER]
    assert scheduler.allocator.num_cached_blocks == 0 and a.block_hashes == []
    scheduler.commit(first, fake_tokens(first))  # output 0 = 10_000 arrives: the block is known
    assert a.block_hashes == chain([500, 501, 502, 10_000], 4)
    assert scheduler.allocator.match_prefix(a.block_hashes, 1) == scheduler.allocator.block_table(0)[:1]
    scheduler.commit(second, fake_tokens(second))
    run_to_end(scheduler)
    # A follow-up turn (prompt + answer + more) finds that generated block.
    follow = prompt_seq(1, [500, 501, 502, *a.output_token_ids[:3], 777])
    scheduler.add(follow)
    out = scheduler.schedule()
    assert [(s.start, s.num_tokens) for s in out.scheduled] == [(4, 3)]


def test_a_preempted_sequence_resumes_on_its_own_cached_blocks():
    scheduler = make(num_blocks=5, block_size=4, budget=16)
    a, b = prompt_seq(0, list(range(500, 508)), max_tokens=4), prompt_seq(1, list(range(600, 608)))
    scheduler.add(a)
    scheduler.add(b)
    out = scheduler.schedule()  # both prompts: 4 blocks, all registered
    scheduler.update(out, fake_tokens(out))
    b_blocks = scheduler.allocator.block_table(1)
    out = scheduler.schedule()  # both need a third block, one is free: B, the newest, is preempted
    assert out.preempted == [b] and b.num_computed_tokens == 0
    assert scheduler.allocator.num_cached_blocks == 2  # B's blocks, kept: nothing needed them
    scheduler.update(out, fake_tokens(out))
    resumed = None
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        resumed = resumed or next((s for s in out.scheduled if s.seq is b), None)
        scheduler.update(out, fake_tokens(out))
    # B resumed after A finished (A's partial last block freed): on its two prompt blocks, computing
    # only its first output token's KV again.
    assert resumed is not None and (resumed.start, resumed.num_tokens) == (8, 1)
    assert scheduler.allocator.block_table(1) == []  # finished
    assert b.output_token_ids == [20_000 + i for i in range(4)]
    assert scheduler.prefix_cache_hits == 8 and b_blocks == [2, 3]
    scheduler.allocator.check_integrity()


def test_aborting_a_request_drops_only_its_references():
    scheduler = make(num_blocks=8, block_size=4, budget=32)
    prompt = list(range(500, 509))
    scheduler.add(prompt_seq(0, prompt, max_tokens=8))
    out = scheduler.schedule()
    scheduler.update(out, fake_tokens(out))
    scheduler.add(prompt_seq(1, prompt, max_tokens=8))
    out = scheduler.schedule()
    shared = scheduler.allocator.block_table(1)[:2]
    assert shared == scheduler.allocator.block_table(0)[:2]
    scheduler.update(out, fake_tokens(out))
    scheduler.abort("r0")  # B still uses the shared blocks: they stay used, not cached or free
    assert scheduler.allocator.num_used_blocks == 3 and scheduler.allocator.num_cached_blocks == 0
    scheduler.allocator.check_integrity()
    run_to_end(scheduler)
    assert scheduler.allocator.num_used_blocks == 0 and scheduler.allocator.num_cached_blocks >= 2
    scheduler.allocator.check_integrity()


COMMON_PREFIX = [5000 + i for i in range(48)]


@dataclass
class Request:
    prompt_len: int  # of its own tokens, after the shared part
    max_tokens: int
    arrive_step: int
    abort_step: int | None
    shared_len: int = 0  # tokens taken from COMMON_PREFIX, or from the request it follows up
    follows: bool = False  # the prompt starts with an earlier request's prompt and outputs (a next turn)


requests_strategy = st.lists(
    st.builds(
        Request,
        st.integers(0, 24),
        st.integers(1, 12),
        st.integers(0, 6),
        st.one_of(st.none(), st.integers(0, 30)),
        st.integers(0, 40),
        st.booleans(),
    ),
    min_size=1,
    max_size=10,
)


def build_prompts(requests: list[Request]) -> list[list[int]]:
    """Each prompt: a shared part (COMMON_PREFIX's start, or an earlier request's prompt followed by
    the outputs the fake model gives it) and tokens of its own; never empty."""
    prompts: list[list[int]] = []
    for seq_id, r in enumerate(requests):
        if r.follows and seq_id > 0:
            earlier = seq_id // 2
            outputs = [10_000 * (earlier + 1) + i for i in range(requests[earlier].max_tokens)]
            shared = (prompts[earlier] + outputs)[: r.shared_len]
        else:
            shared = COMMON_PREFIX[: r.shared_len]
        own = [100 + seq_id * 1000 + i for i in range(r.prompt_len)]
        prompts.append((shared + own) or [7])
    return prompts


@settings(max_examples=300, deadline=None)
@given(
    requests=requests_strategy,
    block_size=st.sampled_from([1, 2, 4, 8]),
    num_blocks=st.integers(4, 40),
    budget=st.integers(4, 48),
    max_seqs=st.integers(1, 6),
    prefix_caching=st.booleans(),
    pipelined=st.booleans(),
)
def test_scheduler_properties(requests, block_size, num_blocks, budget, max_seqs, prefix_caching, pipelined):
    """Under arrivals, aborts and preemption, with prompts sharing prefixes (0 to several blocks, or an
    earlier request's whole turn) and the engine's async order of calls (pipelined: step N+1
    scheduled and advanced before step N is committed): the budget and cap hold, first come first
    served, every output token exactly once; a step starts where the sequence's KV is, which after a
    cache hit is KV of its own tokens; no step writes a block another sequence holds; and at the end no
    block is used (cached blocks may stay)."""
    max_seqs = min(max_seqs, budget)
    capacity = num_blocks * block_size
    prompts = build_prompts(requests)
    # The engine refuses what cannot fit alone; seq ids follow arrival order, as the engine assigns them.
    order = sorted(
        (i for i, r in enumerate(requests) if len(prompts[i]) + r.max_tokens <= capacity),
        key=lambda i: requests[i].arrive_step,
    )
    assume(order)
    requests = [requests[i] for i in order]
    scheduler = make(num_blocks, block_size, budget, max_seqs, capacity, prefix_caching)
    allocator = scheduler.allocator
    seqs = [prompt_seq(new_id, prompts[i], requests[new_id].max_tokens) for new_id, i in enumerate(order)]
    computed = {s.seq_id: 0 for s in seqs}  # tokens whose KV the fake model holds
    kv: dict[int, tuple[Sequence, int]] = {}  # slot -> (the sequence that wrote it, the position)
    first_scheduled: list[int] = []
    aborted: set[int] = set()
    in_flight: SchedulerOutput | None = None
    for step in range(2000):
        for s, r in zip(seqs, requests, strict=True):
            if r.arrive_step == step:
                scheduler.add(s)
            if r.abort_step == step and r.arrive_step <= step and not s.is_finished:
                scheduler.abort(s.request_id)
                aborted.add(s.seq_id)
                assert allocator.block_table(s.seq_id) == []
        if step > max(r.arrive_step for r in requests) and not scheduler.has_unfinished() and not in_flight:
            break
        waiting = {s.seq_id for s in scheduler.waiting}
        out = scheduler.schedule()
        for victim in out.preempted:
            computed[victim.seq_id] = 0
        assert out.num_batched_tokens <= budget
        assert len(out.scheduled) <= max_seqs and scheduler.num_running <= max_seqs
        assert len({s.seq.seq_id for s in out.scheduled}) == len(out.scheduled)
        tables = {s.seq_id: allocator.block_table(s.seq_id) for s in scheduler.running}
        for item in out.scheduled:
            seq, table = item.seq, tables[item.seq.seq_id]
            if seq.seq_id in waiting:  # admitted now: it starts after its cached blocks, if any
                assert item.start % block_size == 0
                assert item.start <= (seq.num_tokens - 1) // block_size * block_size
                assert prefix_caching or item.start == 0
            else:  # recompute starts where the cache is
                assert item.start == computed[seq.seq_id]
            assert len(table) * block_size >= item.start + item.num_tokens
            for position in range(item.start):  # the KV it attends to is of its own tokens
                writer, written_at = kv[table[position // block_size] * block_size + position % block_size]
                assert written_at == position
                assert writer.token_slice(0, position + 1) == seq.token_slice(0, position + 1)
            for position in range(item.start, item.start + item.num_tokens):
                block = table[position // block_size]
                assert sum(block in other for other in tables.values()) == 1, "wrote a shared block"
                kv[block * block_size + position % block_size] = (seq, position)
            computed[seq.seq_id] = item.start + item.num_tokens
            if seq.seq_id not in first_scheduled:
                first_scheduled.append(seq.seq_id)
        allocator.check_integrity()
        if pipelined:  # as the engine: advance this step, then commit the one before
            scheduler.advance(out)
            if in_flight is not None:
                scheduler.commit(in_flight, fake_tokens(in_flight))
            in_flight = None if out.is_empty else out
        else:
            scheduler.update(out, fake_tokens(out))
        allocator.check_integrity()
    else:
        raise AssertionError("requests did not finish: the scheduler stalled")
    assert first_scheduled == sorted(first_scheduled)  # first come, first served
    for s in seqs:
        if s.seq_id in aborted:
            assert s.finish_reason == "abort"
        else:  # ignore_eos: exactly max_tokens, each output index once, in order
            assert s.output_token_ids == [10_000 * (s.seq_id + 1) + i for i in range(s.params.max_tokens)]
            assert s.finish_reason == "length"
    assert allocator.num_used_blocks == 0
    assert allocator.num_free_blocks + allocator.num_cached_blocks == num_blocks
    assert prefix_caching or allocator.num_cached_blocks == 0
    assert 0 <= scheduler.prefix_cache_hits <= scheduler.prefix_cache_queries
    allocator.check_integrity()

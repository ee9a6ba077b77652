"""Continuous batching with chunked prefill and recompute preemption. Plain Python, no torch.

Each step gets a token budget (max_num_batched_tokens) and a cap on running sequences (max_num_seqs).
`schedule` fills the budget in this order:

1. running sequences that decode (one uncomputed token each), oldest first, so that a long prompt
   never stalls the decodes in flight;
2. running sequences still in prefill, oldest first, each a chunk of what the budget leaves;
3. waiting sequences, strictly first come first served, while the budget, the cap and free KV blocks
   allow; none is admitted in a step that had to preempt.

A sequence that needs a block when none is free preempts the newest running sequence (possibly
itself): its blocks are freed and it returns to the front of the waiting queue, keeping the tokens it
generated, to be recomputed later. Example with budget 8 and two requests of prompt 6 and 5 tokens:
step 1 schedules A:6 and B:2 (a chunk), step 2 A:1 (decode) and B:3; B samples its first token only
when its prompt is fully computed.

`advance` applies a launched step before its tokens are known (each sampling sequence gets a
PLACEHOLDER token; max_tokens and the context limit finish sequences here), `commit` writes the
sampled tokens in and finishes sequences on EOS or a stop token; `update` does both at once. The
engine schedules step N+1 between the two, while step N is still on the GPU.

Prefix caching (config.enable_prefix_caching): a sequence being admitted first looks its full blocks
up in the allocator (block_allocator.hash_block explains the hash chain). The blocks found are shared,
their tokens count as computed, and its first chunk starts after them. At most (num_tokens - 1) //
block_size blocks are taken: the last token is always computed, since its logits give the next token,
and the block it falls in is computed whole into a block of the sequence's own, so a shared block is
never written (as vLLM V1 does). Example, block size 4, budget 8: A, a 10-token prompt, runs and its
blocks of tokens 0-3 and 4-7 are registered. B, A's first 8 tokens and 3 others (11), finds both:
num_computed_tokens = 8, and its first step computes tokens 8-10 (3 tokens, not 11). C, exactly A's
first 8 tokens, may take (8 - 1) // 4 = 1 block: it computes tokens 4-7 into a block of its own.
A block is registered once its tokens are computed (or being computed by a launched step) and known
(no PLACEHOLDER among them), in `advance` and `commit`: prompt blocks and generated ones alike.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from engine.block_allocator import BlockAllocator, hash_block
from engine.config import SchedulerConfig
from engine.sequence import PLACEHOLDER, Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    start: int  # tokens already in the cache before this step
    num_tokens: int  # tokens computed this step
    samples: bool = field(init=False)  # this step reaches the sequence's end, so a token is sampled

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """Decodes first, then prefill chunks: the runner relies on that order."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, allocator: BlockAllocator, eos_token_ids: tuple[int, ...] = ()
    ) -> None:
        self.config = config
        self.allocator = allocator
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # arrival order: the newest is last
        self._by_request: dict[str, Sequence] = {}
        self.num_preemptions = 0  # since start: a gauge of KV pressure for tests and metrics
        # Since start, in tokens: those looked up in the prefix cache at admission (each admitted
        # sequence's, a resumed one's again) and those of them found cached, as vLLM counts them.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # -- queue -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        if seq.request_id in self._by_request:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self._by_request[seq.request_id] = seq
        self.waiting.append(seq)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # -- scheduling ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        decodes: list[Sequence] = []
        prefills: list[Sequence] = []
        for seq in self.running:
            (decodes if seq.num_uncomputed_tokens == 1 else prefills).append(seq)
        for group in (decodes, prefills):
            for seq in group:
                if budget == 0:
                    break
                if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this step
                    continue
                num = min(seq.num_uncomputed_tokens, budget)
                ok, refund = self._make_room(seq, seq.num_computed_tokens + num, out)
                budget += refund
                if not ok:
                    continue
                out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num))
                budget -= num
        if not out.preempted:
            self._admit(out, budget)
        return out

    def _make_room(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> tuple[bool, int]:
        """Grow seq's table to num_tokens, preempting the newest running sequences as needed.

        A victim may already be scheduled in this step (a newer decode, when an older prefill chunk
        needs room): it is unscheduled and its tokens are refunded to the budget.
        """
        refund = 0
        while not self.allocator.grow(seq.seq_id, num_tokens):
            victim = self.running[-1]
            for index, item in enumerate(out.scheduled):
                if item.seq is victim:
                    refund += item.num_tokens
                    del out.scheduled[index]
                    break
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is seq:
                return False, refund
        return True, refund

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.release(seq.seq_id)  # only its references: blocks others share stay in use
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Victims go newest first, each to the front, so the queue keeps arrival order.
        self.waiting.appendleft(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in order; each starts after the blocks the prefix cache holds for it
        (a waiting sequence holds no blocks: num_computed_tokens is 0 until here)."""
        block_size = self.allocator.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            num_cached = len(cached) * block_size
            num = min(seq.num_tokens - num_cached, budget)
            if not self.allocator.allocate(seq.seq_id, cached, num_cached + num):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            seq.num_computed_tokens = num_cached
            if self.config.enable_prefix_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += num_cached
            self._insert_running(seq)
            out.scheduled.append(ScheduledSequence(seq, num_cached, num))
            budget -= num

    # -- prefix cache ----------------------------------------------------------------------------
    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks seq may start on: at most (num_tokens - 1) // block_size, so that its
        last token is computed (its logits give the next token) into a block of its own."""
        if not self.config.enable_prefix_caching:
            return []
        max_blocks = (seq.num_tokens - 1) // self.allocator.block_size
        self._hash_blocks(seq, max_blocks)
        return self.allocator.match_prefix(seq.block_hashes, max_blocks)

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Extend seq.block_hashes to its first num_blocks full blocks, or as many as hold only
        committed tokens (a PLACEHOLDER's value is unknown). Each block is hashed once."""
        block_size = self.allocator.block_size
        hashes = seq.block_hashes
        num_blocks = min(num_blocks, (seq.num_tokens - seq.num_pending) // block_size)
        for index in range(len(hashes), num_blocks):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, seq.token_slice(index * block_size, (index + 1) * block_size)))

    def _cache_blocks(self, seq: Sequence) -> None:
        """Register seq's full blocks whose tokens are computed (the step that computes them was
        launched) and committed, so later sequences can share them."""
        ready = min(seq.num_computed_tokens, seq.num_tokens - seq.num_pending) // self.allocator.block_size
        self._hash_blocks(seq, ready)
        self.allocator.cache_blocks(seq.seq_id, seq.block_hashes, ready)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (the allocator's reset_prefix_cache); returns how many."""
        return self.allocator.reset_prefix_cache()

    def _insert_running(self, seq: Sequence) -> None:
        """Keep `running` in arrival order: a resumed (preempted) sequence is older than some running."""
        index = len(self.running)
        while index > 0 and self.running[index - 1].seq_id > seq.seq_id:
            index -= 1
        self.running.insert(index, seq)

    # -- results ---------------------------------------------------------------------------------
    def advance(self, out: SchedulerOutput) -> list[Sequence]:
        """A step was launched: its tokens count as computed, and each sequence that samples gets a
        PLACEHOLDER output token, so the next step can be scheduled (and decode it) before the GPU is
        done. A length limit does not depend on the token's value: such sequences finish here,
        keeping their last, pending token. Returns them."""
        finished: list[Sequence] = []
        max_model_len = self.config.max_model_len
        caching, block_size = self.config.enable_prefix_caching, self.allocator.block_size
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted after scheduling
                continue
            seq.num_computed_tokens = item.start + item.num_tokens
            # A block is ready once computed and committed. A one-token step (a decode) completes one
            # only on a block boundary, and only if its input is known: under async steps it is
            # usually the PLACEHOLDER of the step in flight, and `commit` registers the block.
            if (
                caching
                and seq.num_pending == 0
                and (item.num_tokens > 1 or seq.num_computed_tokens % block_size == 0)
            ):
                self._cache_blocks(seq)
            if not item.samples:
                continue
            seq.output_token_ids.append(PLACEHOLDER)
            seq.num_pending += 1
            if len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= max_model_len:
                self.finish(seq, "length", keep_pending=True)
                finished.append(seq)
        return finished

    def commit(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[Sequence]:
        """The step's tokens arrived (in order of the sequences that sample): write them over the
        placeholders and stop on EOS or a stop token. Returns the sequences this finished."""
        finished: list[Sequence] = []
        tokens = iter(sampled_token_ids)
        caching, block_size = self.config.enable_prefix_caching, self.allocator.block_size
        for item in out.scheduled:
            if not item.samples:
                continue
            token = next(tokens)
            seq = item.seq
            pending = seq.num_pending
            if pending == 0:  # finished meanwhile (abort, stop string, an earlier stop token)
                continue
            index = len(seq.output_token_ids) - pending
            seq.output_token_ids[index] = token
            seq.num_pending = pending - 1
            # The token may complete a block whose KV is computed: only if it ends on a block boundary.
            if (
                caching
                and (len(seq.prompt_token_ids) + index + 1) % block_size == 0
                and seq.status is SequenceStatus.RUNNING
            ):
                self._cache_blocks(seq)
            if not self._is_stop_token(seq, token):
                continue
            if seq.is_finished:  # its length limit was reached with this very token: a stop wins
                seq.finish_reason = "stop"
                continue
            self.finish(seq, "stop")
            finished.append(seq)
        return finished

    def update(self, out: SchedulerOutput, sampled_token_ids: list[int]) -> list[Sequence]:
        """advance and commit at once, for a step whose tokens are already known."""
        return self.advance(out) + self.commit(out, sampled_token_ids)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        params = seq.params
        if not params.ignore_eos and token in self.eos_token_ids:
            return True
        return params.stop_token_ids is not None and token in params.stop_token_ids

    def finish(self, seq: Sequence, reason: str, keep_pending: bool = False) -> None:
        """End seq now (stop string, abort, or a stop condition) and give its blocks back.

        Tokens of steps still in flight are dropped, unless keep_pending (a length limit: the
        pending token is the last one, and commit writes it in).
        """
        if seq.is_finished:
            return
        if seq.num_pending and not keep_pending:
            del seq.output_token_ids[len(seq.output_token_ids) - seq.num_pending :]
            seq.num_pending = 0
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.allocator.release(seq.seq_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._by_request.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        seq = self._by_request.get(request_id)
        if seq is None:
            return None
        self.finish(seq, "abort")
        return seq

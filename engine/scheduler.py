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
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine.block_allocator import BlockAllocator
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
        self.allocator.release(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        # Victims go newest first, each to the front, so the queue keeps arrival order.
        self.waiting.appendleft(seq)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            num = min(seq.num_uncomputed_tokens, budget)
            if not self.allocator.grow(seq.seq_id, seq.num_computed_tokens + num):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._insert_running(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_computed_tokens, num))
            budget -= num

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
        for item in out.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted after scheduling
                continue
            seq.num_computed_tokens = item.start + item.num_tokens
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
        for item in out.scheduled:
            if not item.samples:
                continue
            token = next(tokens)
            seq = item.seq
            if seq.num_pending == 0:  # finished meanwhile (abort, stop string, an earlier stop token)
                continue
            seq.output_token_ids[len(seq.output_token_ids) - seq.num_pending] = token
            seq.num_pending -= 1
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

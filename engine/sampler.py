"""Token selection on the device for a whole batch: penalties, temperature, top-k, top-p, min-p, seeds.

The runner hands the sampler each step's sampling sequences (`prepare`, host side) and the step's
logits (`sample`, device side). Each sequence's settings are written once into a host table row; a step
gathers its rows with numpy into a pinned staging buffer, adds each row's output position, and sends it
with one copy to a device buffer of fixed address: nothing is rebuilt from Python floats per step.

Greedy-only steps take the argmax, as before. Otherwise every row is drawn at once by a Gumbel-max
(argmax of logit + temperature x Gumbel noise over the kept tokens: engine/kernels/sampling.py on CUDA,
its torch reference on CPU), with noise hashed from (the request's key, the token's index in the
output, the token id). So a seeded request draws the same tokens whatever shares its batch, with CUDA
graphs or without, and nothing depends on the engine step (async steps decode placeholder tokens) or
on generator state. A seed is the key; an unseeded request's key mixes the engine seed and the
sequence id (reproducible per engine run).

Filters become one cutoff logit a row (keep the tokens >= it): min-p's is arithmetic, top-k's the k-th
largest logit (torch.topk), top-p's found within the top-k candidates or, for top-p alone, by the
method FILTER_METHOD names (the one place to change it; engine/kernels/bench_sampling.py times them).
Penalties (engine/penalties.py) change the logits first, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from engine.kernels.sampling_reference import (
    row_masses_reference,
    sample_reference,
    top_p_cutoffs_reference,
)
from engine.penalties import PenaltyCounts, apply_penalties
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

MASK64 = (1 << 64) - 1
# Temperatures above this act as infinite (uniform over the kept tokens); capped so that
# temperature x noise stays finite in float32.
MAX_TEMPERATURE = 1e30

# Columns of the per-row parameter table (int32; the float columns hold float32 bit patterns).
TEMPERATURE, TOP_K, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION, KEY_LO, KEY_HI, FLAGS, POSITION = range(11)
NUM_COLUMNS = 11
# FLAGS bits.
RANDOM = 1  # drawn (not greedy)
USES_TOP_K = 2
USES_TOP_P = 4
USES_MIN_P = 8
USES_PENALTY = 16
FILTERS = USES_TOP_K | USES_TOP_P | USES_MIN_P


@dataclass(frozen=True)
class FilterMethod:
    """How top-p alone (no top-k) finds its cutoff; top-k rows always use torch.topk and top-p within.

    sort: sort the rows (the reference). prefix: torch.topk of `prefix` candidates, which settles a row
    when its nucleus ends inside them (peaked distributions); the rows it cannot settle go to the
    search kernel (top_p_cutoffs) on CUDA (no host sync) or a sort on CPU. bisect: the search kernel
    for every such row (a sort on CPU; named for the bisection the kernel once was). Whatever the method, a step with at most `sort_rows` filtered rows sorts
    them: a lone row sorts about as fast as topk finds its candidates, and a sort never falls back.

    On the H200 (bench_sampling, graph-replayed device time, cutoff and draw): top_p 0.9 over peaked
    logits (top 50 tokens ~95% of the mass) at 4 / 16 / 64 / 256 rows, prefix 1024 took 154 / 185 /
    336 / 950 us, the sort 385 / 580 / 1,373 / 4,583, bisect 645 / 670 / 722 / 1,767; over flat
    logits (randn: the nucleus is most of the vocabulary, every row falls back) prefix 769 / 814 / 982
    / 2,500. One row: sort 134 us, prefix 143 (755 flat): hence sort_rows = 1 then. With the cutoff kernel
    a 16-ary search (at most 9 passes over a row, not ~34), at 64 / 256 rows: bisect 538 / 1,483 us
    (either shape), prefix 1024 peaked 334 / 948, flat 799 / 2,225. With each pass of that search
    split over several programs a row (engine/kernels/sampling.py), bisect took 74 / 296 / 964 us at
    1 / 64 / 256 rows, either shape: less than prefix over peaked logits and than the sort of one
    row, so bisect is the default and no row count sorts.
    """

    top_p: Literal["sort", "prefix", "bisect"] = "bisect"
    prefix: int = 1024
    sort_rows: int = 0


FILTER_METHOD = FilterMethod()  # chosen by engine/kernels/bench_sampling.py on the H200

# What `Sampler.warm_up` draws with: every path of `sample` (the draw alone; top-p alone; top-k with
# top-p and min-p; the penalties), so that each kernel those paths launch has been compiled.
WARM_UP_PARAMS = (
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=1.0, top_p=0.95),
    SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05),
    SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1),
)
# Sequence ids of the warm-up's rows: far above any the engine hands out (it counts up from 0).
WARM_UP_SEQ_ID = 1 << 62


@dataclass(frozen=True)
class SamplerConfig:
    vocab_size: int
    max_rows: int  # sampled rows in one step at most
    device: torch.device
    seed: int = 0  # the engine's: keys of unseeded requests
    method: FilterMethod = FILTER_METHOD


@dataclass
class SamplingBatch:
    """What a step's sampling needs on the host: how many rows, which kinds of work apply. The
    per-row values are in the sampler's device buffer."""

    num_rows: int
    any_random: bool = False
    num_filter_rows: int = 0
    k_max: int = 0  # the largest top-k among the rows that use one
    top_p_alone: bool = False  # a row uses top-p without top-k
    num_penalty_rows: int = 0
    rebuilds: list[tuple[int, list[int], list[int]]] = field(default_factory=list)  # (row, prompt, output)


def splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def request_key(seed: int | None, engine_seed: int, seq_id: int) -> int:
    """The 64-bit key of a request's draws: its seed (mod 2^64), else a mix of the engine's seed and
    the sequence id, so unseeded requests differ from each other but repeat across runs."""
    if seed is not None:
        return seed & MASK64
    return splitmix64(splitmix64(engine_seed & MASK64) ^ seq_id)


def _int32(value: int) -> int:
    """A 32-bit pattern as the int32 that holds it."""
    return value - (1 << 32) if value >= 1 << 31 else value


class Sampler:
    def __init__(self, config: SamplerConfig) -> None:
        self.config = config
        self.vocab_size = config.vocab_size
        self.device = config.device
        rows = config.max_rows
        # Host table: one row a sequence, written once (`_slot`); grown when more sequences hold rows.
        self._table = np.zeros((64, NUM_COLUMNS), dtype=np.int32)
        self._slots: dict[int, int] = {}  # seq_id -> table row
        self._free_slots: list[int] = list(range(63, -1, -1))
        # Staging: [penalty batch rows | penalty count rows | filter rows | params rows x columns]
        # int32; on CUDA pinned and double-buffered (a step's copy may still be queued when the next
        # is prepared), with a device twin whose views keep their addresses.
        self._offsets = (0, rows, 2 * rows, 3 * rows)
        size = 3 * rows + rows * NUM_COLUMNS
        pin = config.device.type == "cuda"
        self._hosts = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2 if pin else 1)]
        self._active = 0
        self.device_buffer = (
            torch.zeros(size, dtype=torch.int32, device=config.device) if pin else self._hosts[0]
        )
        dev = self.device_buffer
        self.penalty_batch_rows = dev[:rows]  # [rows] int32: sampled rows with a penalty
        self.penalty_count_rows = dev[rows : 2 * rows]  # [rows] int32: their rows in the count pool
        self.filter_rows = dev[2 * rows : 3 * rows]  # [rows] int32: sampled rows with a filter
        self.params = dev[3 * rows :].view(rows, NUM_COLUMNS)  # [rows, columns] int32
        self.params_float = self.params.view(torch.float32)
        self.penalties = PenaltyCounts(config.vocab_size, rows, config.device)
        self._cuda = config.device.type == "cuda"

    # -- host side -------------------------------------------------------------------------------
    def _slot(self, seq: Sequence) -> int:
        """seq's table row, written from its SamplingParams the first time it samples."""
        if not self._free_slots:
            old = len(self._table)
            self._table = np.concatenate([self._table, np.zeros_like(self._table)])
            self._free_slots = list(range(len(self._table) - 1, old - 1, -1))
        slot = self._free_slots.pop()
        self._slots[seq.seq_id] = slot
        params = seq.params
        row = self._table[slot]
        row_float = row.view(np.float32)
        row[:] = 0
        flags = 0
        if not params.greedy:
            flags |= RANDOM
            row_float[TEMPERATURE] = min(params.temperature, MAX_TEMPERATURE)
            if 0 < params.top_k < self.vocab_size:
                flags |= USES_TOP_K
            if params.top_p < 1.0:
                flags |= USES_TOP_P
            if params.min_p > 0.0:
                flags |= USES_MIN_P
        if params.uses_penalties:
            flags |= USES_PENALTY
        row[TOP_K] = params.top_k if flags & USES_TOP_K else self.vocab_size
        row_float[TOP_P] = params.top_p if flags & USES_TOP_P else 1.0
        row_float[MIN_P] = params.min_p if flags & USES_MIN_P else 0.0
        row_float[PRESENCE] = params.presence_penalty
        row_float[FREQUENCY] = params.frequency_penalty
        row_float[REPETITION] = params.repetition_penalty
        key = request_key(params.seed, self.config.seed, seq.seq_id)
        row[KEY_LO] = _int32(key & 0xFFFFFFFF)
        row[KEY_HI] = _int32(key >> 32)
        row[FLAGS] = flags
        return slot

    def prepare(self, seqs: list[Sequence]) -> SamplingBatch:
        """The step's sampling rows (seqs in the order of the logits rows) into the staging buffer,
        sent to the device unless every row is greedy without penalties (then nothing is read)."""
        n = len(seqs)
        batch = SamplingBatch(n)
        if n == 0:
            return batch
        slot_of = self._slots
        slots = [slot_of.get(seq.seq_id, -1) for seq in seqs]
        if -1 in slots:
            slots = [self._slot(seq) if slot < 0 else slot for seq, slot in zip(seqs, slots, strict=True)]
        if len(self._hosts) > 1:
            self._active ^= 1
        host = self._hosts[self._active].numpy()
        params = host[self._offsets[3] :].reshape(-1, NUM_COLUMNS)[:n]
        np.take(self._table, slots, axis=0, out=params)
        flags = params[:, FLAGS]
        any_flags = int(np.bitwise_or.reduce(flags))
        if any_flags == 0:
            return batch
        # The index in the output of the token each row samples: the draw's counter.
        params[:, POSITION] = [len(seq.output_token_ids) for seq in seqs]
        batch.any_random = bool(any_flags & RANDOM)
        if any_flags & FILTERS:
            filter_rows = np.flatnonzero(flags & FILTERS)
            batch.num_filter_rows = len(filter_rows)
            host[self._offsets[2] : self._offsets[2] + len(filter_rows)] = filter_rows
            uses = flags[filter_rows]
            top_k = params[filter_rows, TOP_K][(uses & USES_TOP_K) != 0]
            batch.k_max = int(top_k.max()) if len(top_k) else 0
            batch.top_p_alone = bool(((uses & (USES_TOP_K | USES_TOP_P)) == USES_TOP_P).any())
        if any_flags & USES_PENALTY:
            penalty_rows = np.flatnonzero(flags & USES_PENALTY)
            batch.num_penalty_rows = len(penalty_rows)
            host[: len(penalty_rows)] = penalty_rows
            for j, i in enumerate(penalty_rows.tolist()):
                seq = seqs[i]
                row, new = self.penalties.row(seq)
                host[self._offsets[1] + j] = row
                if new:
                    batch.rebuilds.append((row, seq.prompt_token_ids, list(seq.output_token_ids)))
        if self.device_buffer is not self._hosts[self._active]:
            end = self._offsets[3] + n * NUM_COLUMNS
            self.device_buffer[:end].copy_(self._hosts[self._active][:end], non_blocking=True)
        return batch

    def preempted(self, seq_id: int) -> None:
        """seq's KV was dropped and will be recomputed: its counts are rebuilt when it samples again."""
        self.penalties.drop(seq_id)

    def release(self, seq_id: int) -> None:
        slot = self._slots.pop(seq_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        self.penalties.drop(seq_id)

    def warm_up(self, logits: torch.Tensor) -> None:
        """Draw from `logits` ([rows, vocab] float32: scratch, overwritten) with each of
        WARM_UP_PARAMS, at one row and at every row, and forget those rows.

        Why: Triton compiles a kernel's variant the first time it is launched (a fraction of a second
        each), and the sampler's first sampled step would otherwise pay for it in the middle of
        serving. The kernels' variants do not depend on the row count (engine/kernels/sampling.py),
        so one row and many cover every batch. The engine's start-up profile run calls this on its
        largest logits, so the memory it takes is counted before the KV cache is sized.
        """
        for params in WARM_UP_PARAMS:
            for rows in sorted({1, logits.shape[0]}):
                seqs = [
                    Sequence(WARM_UP_SEQ_ID + i, "warm-up", [i % self.vocab_size], params)
                    for i in range(rows)
                ]
                self.sample(logits[:rows], self.prepare(seqs))
                for seq in seqs:
                    self.release(seq.seq_id)

    # -- device side -----------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [rows, vocab] float32 (modified in place by penalties) -> [rows] int64 token ids, on
        the logits' device, without a host sync."""
        n = batch.num_rows
        penalty_rows = count_rows = None
        if batch.num_penalty_rows:
            for row, prompt, output in batch.rebuilds:
                self.penalties.rebuild(row, prompt, output)
            penalty_rows = self.penalty_batch_rows[: batch.num_penalty_rows].long()
            count_rows = self.penalty_count_rows[: batch.num_penalty_rows].long()
            if self._cuda:
                from engine.kernels.sampling import apply_penalties_in_place

                values = self.params_float[:n]
                apply_penalties_in_place(
                    logits,
                    self.penalties.reserve(),
                    self.penalty_batch_rows[: batch.num_penalty_rows],
                    self.penalty_count_rows[: batch.num_penalty_rows],
                    values[:, PRESENCE],
                    values[:, FREQUENCY],
                    values[:, REPETITION],
                )
            else:
                values = self.params_float[:n].index_select(0, penalty_rows)
                penalized = apply_penalties(
                    logits.index_select(0, penalty_rows),
                    self.penalties.reserve().index_select(0, count_rows),
                    values[:, PRESENCE],
                    values[:, FREQUENCY],
                    values[:, REPETITION],
                )
                logits.index_copy_(0, penalty_rows, penalized)
        if not batch.any_random:
            tokens = logits.argmax(dim=-1)
        else:
            cutoff = self._cutoffs(logits, batch) if batch.num_filter_rows else None
            params = self.params[:n]
            temperature = self.params_float[:n, TEMPERATURE]
            draw = _kernel_sample if self._cuda else sample_reference
            tokens = draw(
                logits, temperature, cutoff, params[:, KEY_LO], params[:, KEY_HI], params[:, POSITION]
            )
        if penalty_rows is not None and count_rows is not None:
            self.penalties.count(tokens, penalty_rows, count_rows)
        return tokens

    def _cutoffs(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """[rows] float32 cutoff logits: -inf for the rows without a filter."""
        n, m = batch.num_rows, batch.num_filter_rows
        rows = self.filter_rows[:m]
        values = self.params_float[:n].index_select(0, rows.long()) if m < n else self.params_float[:n]
        cutoff = filter_cutoffs(
            logits,
            rows,
            values[:, TEMPERATURE],
            values.view(torch.int32)[:, TOP_K],
            values[:, TOP_P],
            values[:, MIN_P],
            k_max=batch.k_max,
            top_p_alone=batch.top_p_alone,
            method=self.config.method,
        )
        if m == n:
            return cutoff
        full = torch.full((n,), float("-inf"), device=logits.device)
        return full.index_copy_(0, rows.long(), cutoff)


def _kernel_sample(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cutoff: torch.Tensor | None,
    key_lo: torch.Tensor,
    key_hi: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    from engine.kernels.sampling import sample_rows

    return sample_rows(logits, temperature, key_lo, key_hi, position, cutoff=cutoff)


def filter_cutoffs(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    k_max: int,
    top_p_alone: bool,
    method: FilterMethod = FILTER_METHOD,
) -> torch.Tensor:
    """The cutoff logit of each filtered row: its kept tokens are those with logit >= cutoff.

    logits [*, vocab] float32 (after penalties); rows [m] int32: the filtered rows of logits;
    temperature [m] float32 (> 0), top_k [m] int32 (vocab: off), top_p [m] (1: off), min_p [m] (0:
    off). k_max: the largest top_k in use (0: none); top_p_alone: some row has top-p without top-k.
    Returns [m] float32.

    As vLLM: min-p first (keep p >= min_p x p_max, i.e. logit >= max + temperature x log(min_p)),
    then top-k (logit >= the k-th largest), then top-p over what is left, renormalized (keep a token
    when the mass ranked strictly above it is < top_p; the most likely always stays). Tokens tied
    with the cutoff are all kept.
    """
    vocab = logits.shape[1]
    m = rows.shape[0]
    selected = logits if m == logits.shape[0] else logits.index_select(0, rows.long())  # [m, vocab]
    # A float32 temperature of 0 (a tiny one, rounded) would make 0 / 0 below.
    temperature = temperature.clamp(min=torch.finfo(torch.float32).tiny)
    top = selected.amax(dim=-1)
    lower = top + temperature * torch.log(min_p)  # -inf where min-p is off
    if k_max == 0 and not top_p_alone:
        return lower
    if method.top_p == "sort" or m <= method.sort_rows:
        candidates = vocab
    elif method.top_p == "prefix" and top_p_alone:
        candidates = min(max(k_max, method.prefix), vocab)
    else:
        candidates = k_max
    uses_top_k = top_k < vocab
    uses_top_p = top_p < 1.0
    # The prefix method settles top-p-alone rows within its candidates when it can; bisect never.
    settle_in_candidates = method.top_p == "prefix"
    if candidates == 0:  # "bisect" with top-p alone only: every filtered row is settled below
        cutoff = lower
    else:
        if candidates < vocab:
            values = selected.topk(candidates, dim=-1, sorted=True).values  # [m, candidates]
        else:
            values = selected.sort(dim=-1, descending=True).values
        rank = torch.arange(candidates, device=logits.device)
        kept = (rank[None, :] < top_k[:, None]) & (values >= lower[:, None])
        weights = torch.exp((values - top[:, None]) / temperature[:, None]).masked_fill_(~kept, 0.0)
        total = weights.sum(dim=-1)
        if top_p_alone and candidates < vocab and settle_in_candidates:
            # Top-p alone renormalizes over every token min-p keeps, not just the candidates.
            if logits.device.type == "cuda":
                from engine.kernels.sampling import row_masses

                row_total = row_masses(logits, rows, top.contiguous(), temperature, lower)
            else:
                row_total = row_masses_reference(selected, top, temperature, lower)
            total = torch.where(uses_top_k, total, row_total)
        before = weights.cumsum(dim=-1) - weights
        kept &= ~uses_top_p[:, None] | (before < top_p[:, None] * total[:, None])
        kept[:, 0] = True
        count = kept.sum(dim=-1)
        cutoff = values.gather(1, (count - 1)[:, None])[:, 0]
        cutoff = torch.where(uses_top_k | uses_top_p, cutoff, lower)
    if top_p_alone and candidates < vocab:
        # Top-p rows whose nucleus runs past the candidates (all of them when there were none).
        unsettled = uses_top_p & ~uses_top_k
        if candidates and settle_in_candidates:
            unsettled &= count == candidates
        cutoff = cutoff.contiguous()
        if logits.device.type == "cuda":
            from engine.kernels.sampling import top_p_cutoffs

            top_p_cutoffs(
                logits,
                rows,
                temperature,
                top_p.contiguous(),
                lower,
                unsettled.int(),
                cutoff,
                top=top.contiguous(),
            )
        else:  # the host may look: sort just those rows
            index = unsettled.nonzero()[:, 0]
            if len(index):
                cutoff[index] = top_p_cutoffs_reference(
                    selected[index], temperature[index], top_p[index], lower[index]
                )
    return cutoff

"""Repetition, presence and frequency penalties, as vLLM applies them, from token counts kept on the device.

Only sequences that use a penalty get a count row: a pool of [rows, vocab] int32 counts, grown on
demand (a row is 0.6 MB at vocab 151,936, so max_num_seqs rows up front would be wasted on the usual
request that uses none). A row holds the sequence's output-token counts in its low bits and PROMPT_FLAG
for each token of its prompt, so the repetition penalty (prompt and output) and the presence and
frequency penalties (output only) read one row. The sampler (engine/sampler.py) assigns rows when it
prepares a step and calls `rebuild`, `apply` and `count` while it samples. Counts advance from each
step's sampled tokens on the device (`count`), never from the host, whose latest token may still be a
placeholder of the step in flight; a row is rebuilt from the host's token lists only when a sequence
first gets it, which is also what happens after a recompute preemption (the row was dropped then).
Every device operation is queued on the one stream, in step order, so a row freed and handed to
another sequence is rebuilt only after the last count of its former owner.
"""

from __future__ import annotations

import torch

from engine.kernels.sampling_reference import OUTPUT_COUNT_MASK, PROMPT_FLAG, apply_penalties
from engine.sequence import PLACEHOLDER, Sequence

__all__ = ["OUTPUT_COUNT_MASK", "PROMPT_FLAG", "PenaltyCounts", "apply_penalties"]


class PenaltyCounts:
    """The pool of count rows, by sequence id; the device tensor grows when more rows are needed."""

    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self.device = device
        self.counts: torch.Tensor | None = None  # [capacity, vocab] int32, made in the first `reserve`
        self._rows: dict[int, int] = {}  # seq_id -> row
        self._free: list[int] = []
        self._num_rows = 0  # rows ever handed out: the capacity the device tensor must have
        self._ones: torch.Tensor | None = None  # [max_rows] int32, the increments of `count`

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, seq: Sequence) -> tuple[int, bool]:
        """seq's row, and whether it is new (to be rebuilt from seq's tokens before it is read)."""
        row = self._rows.get(seq.seq_id)
        if row is not None:
            return row, False
        if self._free:
            row = self._free.pop()
        else:
            row = self._num_rows
            self._num_rows += 1
        self._rows[seq.seq_id] = row
        return row, True

    def drop(self, seq_id: int) -> None:
        """seq's counts are no longer valid (finished, aborted, or preempted: rebuilt when it resumes)."""
        row = self._rows.pop(seq_id, None)
        if row is not None:
            self._free.append(row)

    # -- device work, called while sampling (under inference mode) --------------------------------
    def reserve(self) -> torch.Tensor:
        """The count tensor, grown (doubling, up to max_rows and at least every row handed out)."""
        capacity = 0 if self.counts is None else self.counts.shape[0]
        if self._num_rows > capacity:
            grown = max(self._num_rows, min(max(2 * capacity, 8), self.max_rows))
            counts = torch.zeros(grown, self.vocab_size, dtype=torch.int32, device=self.device)
            if self.counts is not None:
                counts[:capacity] = self.counts
            self.counts = counts
        if self._ones is None:
            self._ones = torch.ones(self.max_rows, dtype=torch.int32, device=self.device)
        assert self.counts is not None
        return self.counts

    def rebuild(self, row: int, prompt: list[int], output: list[int]) -> None:
        """Row from the host's lists: PROMPT_FLAG on the prompt's tokens, the output's tokens counted."""
        counts = self.reserve()[row]
        counts.zero_()
        if PLACEHOLDER in output:
            # A row is rebuilt only when its sequence has no step in flight (first sample, or resumed
            # after a preemption, once the engine committed its last token): a placeholder is a bug.
            raise RuntimeError("penalty counts rebuilt while a token of the sequence is in flight")
        pin = self.device.type == "cuda"
        ids = torch.tensor(prompt + output, dtype=torch.int64, pin_memory=pin).to(
            self.device, non_blocking=True
        )
        counts.index_fill_(0, ids[: len(prompt)], PROMPT_FLAG)
        if output:
            assert self._ones is not None
            counts.index_add_(0, ids[len(prompt) :], self._ones[:1].expand(len(output)))

    def count(self, tokens: torch.Tensor, batch_rows: torch.Tensor, rows: torch.Tensor) -> None:
        """Add each sampled token to its sequence's row. tokens [num_sampled] int64; batch_rows, rows
        [n] int64: which entries of tokens, and their count rows (distinct)."""
        counts = self.reserve()
        assert self._ones is not None
        sampled = tokens.index_select(0, batch_rows)
        counts.index_put_((rows, sampled), self._ones[: rows.shape[0]], accumulate=True)

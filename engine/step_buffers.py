"""The runner's per-step input tensors: an int32 host buffer, pinned on CUDA, and its device twin.

Both are carved into segments at fixed offsets (input ids, positions, KV slots, context lengths,
query offsets, sampled rows, rows fed from the previous step's tokens, block tables; and the
attention's view of a step that replays a mixed-step graph: the decodes' context lengths, zero past
them, and the prompt chunks' offsets, lengths and block tables, padded to a fixed count), sized for the
largest step. The runner writes a step with numpy into the host views and sends it with one copy; the
device views keep their addresses from step to step, which is what lets a CUDA graph captured over
them replay with new contents. The host side is double-buffered (`flip`): a step is prepared while
the previous one's copy may still be queued behind the GPU's work.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class StepCapacity:
    max_tokens: int  # max_num_batched_tokens
    max_seqs: int  # max_num_seqs (or more, for the start-up profile run)
    max_blocks_per_seq: int  # ceil(max_model_len / block_size)
    graph_prefills: int = 8  # prompt chunks a step may carry and still replay a mixed-step graph


# Segment order: the small per-sequence ones first, block tables last, so a step's upload can stop
# at the end of the rows it used.
_SEGMENTS = (
    "seq_lens",
    "query_start_loc",
    "sample_indices",
    "feed_rows",
    "feed_sources",
    "decode_seq_lens",
    "prefill_query_start_loc",
    "prefill_seq_lens",
    "input_ids",
    "positions",
    "slot_mapping",
    "prefill_block_tables",
    "block_tables",
)


class StepBuffers:
    """Host views (`host_*`, numpy) the runner fills and device views (`*`, torch) the model reads."""

    def __init__(self, capacity: StepCapacity, device: torch.device) -> None:
        self.capacity = capacity
        t, s, b = capacity.max_tokens, capacity.max_seqs, capacity.max_blocks_per_seq
        p = capacity.graph_prefills
        sizes = {
            "seq_lens": s,
            "query_start_loc": s + 1,
            "sample_indices": s,
            "feed_rows": s,
            "feed_sources": s,
            "decode_seq_lens": s,
            "prefill_query_start_loc": p + 1,
            "prefill_seq_lens": p,
            "input_ids": t,
            "positions": t,
            "slot_mapping": t,
            "prefill_block_tables": p * b,
            "block_tables": s * b,
        }
        self._offsets: dict[str, int] = {}
        total = 0
        for name in _SEGMENTS:
            self._offsets[name] = total
            total += sizes[name]
        pin = device.type == "cuda"
        self._hosts = [torch.zeros(total, dtype=torch.int32, pin_memory=pin) for _ in range(2 if pin else 1)]
        self.device_buffer = torch.zeros(total, dtype=torch.int32, device=device) if pin else self._hosts[0]
        self._sizes = sizes
        self._active = 0
        self._bind_host()
        view = {name: slice(self._offsets[name], self._offsets[name] + sizes[name]) for name in _SEGMENTS}
        dev = self.device_buffer
        self.seq_lens = dev[view["seq_lens"]]
        self.query_start_loc = dev[view["query_start_loc"]]
        self.sample_indices = dev[view["sample_indices"]]
        self.feed_rows = dev[view["feed_rows"]]
        self.feed_sources = dev[view["feed_sources"]]
        self.input_ids = dev[view["input_ids"]]
        self.positions = dev[view["positions"]]
        self.slot_mapping = dev[view["slot_mapping"]]
        self.decode_seq_lens = dev[view["decode_seq_lens"]]
        self.prefill_query_start_loc = dev[view["prefill_query_start_loc"]]
        self.prefill_seq_lens = dev[view["prefill_seq_lens"]]
        self.prefill_block_tables = dev[view["prefill_block_tables"]].view(p, b)
        self.block_tables = dev[view["block_tables"]].view(s, b)

    def _bind_host(self) -> None:
        self.host = self._hosts[self._active]
        host_np = self.host.numpy()
        cap = self.capacity

        def view(name: str) -> np.ndarray:
            return host_np[self._offsets[name] : self._offsets[name] + self._sizes[name]]

        self.host_seq_lens = view("seq_lens")
        self.host_query_start_loc = view("query_start_loc")
        self.host_sample_indices = view("sample_indices")
        self.host_feed_rows = view("feed_rows")
        self.host_feed_sources = view("feed_sources")
        self.host_input_ids = view("input_ids")
        self.host_positions = view("positions")
        self.host_slot_mapping = view("slot_mapping")
        self.host_decode_seq_lens = view("decode_seq_lens")
        self.host_prefill_query_start_loc = view("prefill_query_start_loc")
        self.host_prefill_seq_lens = view("prefill_seq_lens")
        self.host_prefill_block_tables = view("prefill_block_tables").reshape(
            cap.graph_prefills, cap.max_blocks_per_seq
        )
        self.host_block_tables = view("block_tables").reshape(cap.max_seqs, cap.max_blocks_per_seq)

    def flip(self) -> None:
        """Switch to the other host buffer: the last one's upload may not have run yet."""
        if len(self._hosts) > 1:
            self._active ^= 1
            self._bind_host()

    def upload(self, num_table_rows: int) -> None:
        """Send the host buffer to the device, up to the end of the first num_table_rows table rows."""
        if self.device_buffer is self.host:
            return
        end = self._offsets["block_tables"] + num_table_rows * self.capacity.max_blocks_per_seq
        self.device_buffer[:end].copy_(self.host[:end], non_blocking=True)


class BlockTableRows:
    """Each running sequence's block table as a numpy row, kept up to date by difference.

    Tables only grow while a sequence runs, so a step copies just the new block ids. A sequence that
    is preempted, finished or aborted must be dropped (its blocks are freed and may come back in
    another order); a table shorter than its cached row is taken as a new table.
    """

    def __init__(self, max_rows: int, max_blocks_per_seq: int) -> None:
        self.array = np.zeros((max_rows, max_blocks_per_seq), dtype=np.int32)
        self._free_rows = list(range(max_rows - 1, -1, -1))
        self._rows: dict[int, tuple[int, int]] = {}  # seq_id -> (row, blocks copied)

    def row(self, seq_id: int, table: list[int]) -> int:
        row, copied = self._rows.get(seq_id, (-1, 0))
        if row < 0 or len(table) < copied:
            if row < 0:
                row = self._free_rows.pop()
            copied = 0
        if len(table) > copied:
            self.array[row, copied : len(table)] = table[copied:]
            self._rows[seq_id] = (row, len(table))
        elif seq_id not in self._rows:
            self._rows[seq_id] = (row, 0)
        return row

    def drop(self, seq_id: int) -> None:
        entry = self._rows.pop(seq_id, None)
        if entry is not None:
            self._free_rows.append(entry[0])

    def __len__(self) -> int:
        return len(self._rows)

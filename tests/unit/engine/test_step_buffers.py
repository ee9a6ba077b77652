"""The runner's step inputs: block-table rows kept by difference, the graph batch ladder, and one
step's buffers (positions, slots, context lengths) for a mixed batch, checked by hand."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cuda_graphs import batch_size_ladder
from engine.step_buffers import BlockTableRows, StepBuffers, StepCapacity


@given(st.lists(st.tuples(st.integers(0, 5), st.sampled_from(["grow", "drop", "renew"])), max_size=60))
@settings(max_examples=200, deadline=None)
def test_rows_follow_the_tables_they_are_given(ops):
    rows = BlockTableRows(max_rows=6, max_blocks_per_seq=8)
    tables: dict[int, list[int]] = {}
    next_block = 0
    for seq_id, op in ops:
        if op == "drop":
            rows.drop(seq_id)
            tables.pop(seq_id, None)
            continue
        table = tables.setdefault(seq_id, [])
        if op == "renew":  # preempted and re-admitted: new blocks, dropped in between
            rows.drop(seq_id)
            table.clear()
        if len(table) < 8:
            table.append(next_block)
            next_block += 1
        row = rows.row(seq_id, table)
        assert rows.array[row, : len(table)].tolist() == table
    assert len(rows) == len(tables)
    used = [rows.row(seq_id, table) for seq_id, table in tables.items()]
    assert len(set(used)) == len(used), "two sequences share a row"


def test_a_shorter_table_is_taken_as_new():
    rows = BlockTableRows(max_rows=2, max_blocks_per_seq=4)
    row = rows.row(7, [3, 4, 5])
    assert rows.row(7, [9]) == row
    assert rows.array[row, :1].tolist() == [9]


@pytest.mark.parametrize(
    ("max_batch", "expected_head", "expected_tail"),
    [(1, [1], [1]), (3, [1, 2, 3], [3]), (256, [1, 2, 4, 8, 16, 24], [224, 240, 256]), (100, [1], [96, 100])],
)
def test_ladder(max_batch, expected_head, expected_tail):
    sizes = batch_size_ladder(max_batch)
    assert sizes[: len(expected_head)] == expected_head
    assert sizes[-len(expected_tail) :] == expected_tail
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch


def test_buffers_share_one_host_block_and_views_do_not_overlap():
    buffers = StepBuffers(StepCapacity(max_tokens=16, max_seqs=4, max_blocks_per_seq=3), torch.device("cpu"))
    views = [
        buffers.host_seq_lens,
        buffers.host_query_start_loc,
        buffers.host_sample_indices,
        buffers.host_feed_rows,
        buffers.host_feed_sources,
        buffers.host_decode_seq_lens,
        buffers.host_prefill_query_start_loc,
        buffers.host_prefill_seq_lens,
        buffers.host_input_ids,
        buffers.host_positions,
        buffers.host_slot_mapping,
        buffers.host_prefill_block_tables,
        buffers.host_block_tables,
    ]
    for index, view in enumerate(views):
        view[...] = index + 1
    host = buffers.host.numpy()
    assert sorted(np.unique(host).tolist()) == list(range(1, len(views) + 1))
    assert host.size == sum(v.size for v in views)
    assert buffers.block_tables.shape == (4, 3)
    assert buffers.prefill_block_tables.shape == (8, 3)
    assert int(buffers.slot_mapping[0]) == 11  # device views read the same memory on CPU


def test_fill_writes_a_mixed_step(tiny_model_dir):
    from engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=str(tiny_model_dir), device="cpu", block_size=4, max_model_len=64))
    runner = engine.runner
    rows = runner.tables.array
    rows[3, :2] = [2, 0]  # a decode at position 5: block index 1 -> block 0, offset 1
    rows[1, :1] = [1]  # a prefill chunk of 3 tokens from position 0: block 1
    meta = runner._fill(np.array([5, 0]), np.array([1, 3]), np.array([11, 12, 13, 14]), [3, 1])
    buffers = runner.buffers
    assert buffers.host_input_ids[:4].tolist() == [11, 12, 13, 14]
    assert buffers.host_positions[:4].tolist() == [5, 0, 1, 2]
    assert buffers.host_slot_mapping[:4].tolist() == [1, 4, 5, 6]
    assert buffers.host_seq_lens[:2].tolist() == [6, 3]
    assert (meta.num_decodes, meta.max_decode_len, meta.seq_lens_cpu) == (1, 6, [6, 3])
    assert meta.query_start_loc_cpu == [0, 1, 4] == buffers.host_query_start_loc[:3].tolist()
    assert meta.max_prefill_len == 3
    assert meta.block_tables[:, :2].tolist() == [[2, 0], [1, 0]]


def test_the_graph_view_of_a_mixed_step_pads_decodes_and_chunks(tiny_model_dir):
    """What a mixed-step graph's attention reads: the decodes' lengths then zeros up to the rows the
    graph gives the decode kernel (stale values there would make it attend for rows nobody reads);
    the chunks' absolute offsets, lengths and tables, then empty chunks (offset = the step's tokens)."""
    from engine import EngineArgs, LLMEngine

    engine = LLMEngine(EngineArgs(model=str(tiny_model_dir), device="cpu", block_size=4, max_model_len=64))
    runner = engine.runner
    buffers = runner.buffers
    for view in (
        buffers.host_decode_seq_lens,
        buffers.host_prefill_seq_lens,
        buffers.host_prefill_query_start_loc,
    ):
        view[:] = 99  # a previous step's leftovers
    rows = runner.tables.array
    rows[0, :2], rows[1, :1], rows[2, :3], rows[3, :1] = [7, 8], [3], [4, 5, 6], [9]
    # Two decodes (positions 5 and 0), then chunks of 3 tokens (from 0) and 2 tokens (from 8).
    runner._fill(np.array([5, 0, 0, 8]), np.array([1, 1, 3, 2]), np.arange(7), [0, 1, 2, 3])
    runner._fill_graph_view(n=4, num_decodes=2, num_tokens=7, rows=6)
    assert buffers.host_decode_seq_lens[:7].tolist() == [6, 1, 0, 0, 0, 0, 99]
    chunks = buffers.capacity.graph_prefills
    assert buffers.host_prefill_query_start_loc.tolist() == [2, 5, 7] + [7] * (chunks - 2)
    assert buffers.host_prefill_seq_lens.tolist() == [3, 10] + [0] * (chunks - 2)
    assert buffers.host_prefill_block_tables[:2, :3].tolist() == [[4, 5, 6], [9, 0, 0]]

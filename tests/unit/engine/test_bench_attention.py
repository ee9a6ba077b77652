"""engine.kernels.bench_attention's set-up of a mixed graph's decode rows (the timing needs CUDA: device only)."""

from __future__ import annotations

import torch

from engine.kernels import bench_attention


def test_mixed_rows_past_the_decodes_are_empty_and_not_counted():
    batch, context, rows = 3, 40, 8
    query, kv_cache, tables, moved = bench_attention.decode_setup(batch, context, torch.device("cpu"), rows)
    assert query.shape == (rows, bench_attention.NUM_HEADS, bench_attention.HEAD_DIM)
    blocks_per_seq = -(-context // bench_attention.BLOCK_SIZE)
    for block_tables, seq_lens in tables:
        assert seq_lens.tolist() == [context] * batch + [0] * (rows - batch)
        assert block_tables.shape == (rows, blocks_per_seq)
        assert not block_tables[batch:].any()
        # the decodes' blocks are distinct cache blocks, as a real step's are
        assert block_tables[:batch].unique().numel() == batch * blocks_per_seq
    unpadded = bench_attention.decode_setup(batch, context, torch.device("cpu"))
    assert unpadded[0].shape[0] == batch
    assert moved == unpadded[3]  # the empty rows move no K/V
    assert kv_cache.shape[1] == len(tables) * batch * blocks_per_seq

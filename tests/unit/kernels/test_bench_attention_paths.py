"""engine.kernels.bench_attention's mixed-graph cases and their sweep run end to end (on CPU through the
interpreter, with one untimed call standing in for the graph timing): a figure per split count, the
sweep's tiles on the first case only."""

from __future__ import annotations

import torch

from engine.kernels import bench_attention


def test_mixed_cases_time_every_split_and_sweep_the_first(monkeypatch, device):
    timed: list[int] = []

    def run_once(calls, rounds, replays):
        for call in calls:
            call()
        timed.append(len(calls))
        return 0.5

    monkeypatch.setattr(bench_attention, "graph_ms", run_once)
    monkeypatch.setattr(bench_attention, "MAX_COPIES", 2)  # copies of the block tables a timed graph takes
    monkeypatch.setattr(bench_attention, "MIXED_CASES", [(2, 40, 5), (1, 24, 3)])
    monkeypatch.setattr(bench_attention, "MIXED_SPLITS", (1, 2))
    monkeypatch.setattr(bench_attention, "SWEEP_TILES", [(16, 4, 2), (32, 4, 2)])
    results = bench_attention.bench_mixed(device, ceiling=100.0, sweep=True)
    assert [(r["decodes"], r["rows"], r["num_splits"]) for r in results] == [
        (2, 5, 1), (2, 5, 2), (1, 3, 1), (1, 3, 2),
    ]  # fmt: skip
    sweep = results[0]["sweep"]
    # splits 1 and 2 (twice the one chosen), each tile once
    assert sorted((entry["splits"], tuple(entry["tile"])) for entry in sweep) == [
        (1, (16, 4, 2)), (1, (32, 4, 2)), (2, (16, 4, 2)), (2, (32, 4, 2)),
    ]  # fmt: skip
    assert all("sweep" not in r for r in results[1:])
    assert timed == [2] * (4 + 4)
    element = torch.finfo(bench_attention.DTYPE).bits // 8
    assert (
        results[0]["bytes"] >= 2 * 40 * bench_attention.NUM_KV_HEADS * bench_attention.HEAD_DIM * element * 2
    )

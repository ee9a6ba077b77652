"""engine.kernels.bench_attention's mixed-graph and seed-mix cases, their sweeps, the planned kernel
beside the one-split-count one and the comparison with another version of the kernel run end to end (on CPU through the interpreter, with one untimed call
standing in for the graph timing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.kernels import bench_attention, decode_attention
from engine.kernels.timing import load_kernel_module


def untimed_graphs(monkeypatch, milliseconds: float) -> list[int]:
    """bench_attention's graph timing replaced by one call of each of its calls (the interpreter has no
    graphs), reporting `milliseconds`; returns the list that notes each timing's number of calls."""
    timed: list[int] = []

    def run_once(calls, rounds, replays):
        for call in calls:
            call()
        timed.append(len(calls))
        return milliseconds

    monkeypatch.setattr(bench_attention, "graph_ms", run_once)
    return timed


def test_mixed_cases_time_every_split_and_sweep_the_first(monkeypatch, device):
    timed = untimed_graphs(monkeypatch, 0.5)
    monkeypatch.setattr(bench_attention, "MAX_COPIES", 2)  # copies of the block tables a timed graph takes
    monkeypatch.setattr(bench_attention, "MIXED_CASES", [(2, 40, 5), (1, 24, 3)])
    monkeypatch.setattr(bench_attention, "MIXED_SPLITS", (1, 2))
    monkeypatch.setattr(bench_attention, "SWEEP_TILES", [(16, 4, 2), (32, 4, 2)])
    results = bench_attention.bench_mixed(device, 132, ceiling=100.0, sweep=True)
    assert [(r["decodes"], r["rows"], r["num_splits"]) for r in results] == [
        (2, 5, 1), (2, 5, 2), (1, 3, 1), (1, 3, 2),
    ]  # fmt: skip
    sweep = results[0]["sweep"]
    # splits 1 and 2 (twice the one chosen), each tile once
    assert sorted((entry["splits"], tuple(entry["tile"])) for entry in sweep) == [
        (1, (16, 4, 2)), (1, (32, 4, 2)), (2, (16, 4, 2)), (2, (32, 4, 2)),
    ]  # fmt: skip
    assert all("sweep" not in r for r in results[1:])
    # each case's first entry: the planned kernel (a mixed step's) beside the one-count kernel, three
    # times each alternating, and its plan once
    for first in (results[0], results[2]):
        assert first["planned"]["speedup"] == 1.0 and first["planned"]["num_splits"] == 16
    assert first["planned"]["decodes"] == 1
    assert timed == [2] * 2 + [2] * 6 + [1] + [2] * 4 + [2] * 2 + [2] * 6 + [1]  # splits, planned, sweep
    element = torch.finfo(bench_attention.DTYPE).bits // 8
    assert (
        results[0]["bytes"] >= 2 * 40 * bench_attention.NUM_KV_HEADS * bench_attention.HEAD_DIM * element * 2
    )


def test_seed_mix_cases_time_this_version_against_another(monkeypatch, device):
    """The seed-mix contexts' cases end to end: this version at its graph choice of splits, the other
    version (here the same file loaded apart) at its own, alternating three times each."""
    timed = untimed_graphs(monkeypatch, 0.25)
    monkeypatch.setattr(bench_attention, "MAX_COPIES", 1)
    monkeypatch.setattr(bench_attention, "SEED_MIX_CASES", [(3, 5)])
    monkeypatch.setattr(bench_attention, "SEED_MIX_PROMPTS", (16, 300))
    other = load_kernel_module(Path(decode_attention.__file__), "paged_decode_attention")
    results = bench_attention.bench_seed_mix(device, 8, ceiling=100.0, against=other)
    (result,) = results
    assert result["decodes"] == 3 and result["rows"] == 5 and len(result["contexts"]) == 3
    assert all(16 < length <= 300 + 256 for length in result["contexts"])
    assert result["against"]["speedup"] == 1.0 and result["against"]["file"] == decode_attention.__file__
    assert result["planned"]["speedup"] == 1.0 and result["planned"]["plan_ms"] == 0.25
    assert timed == [1] * (1 + 2 * 3 + 1 + 2 * 3)


def test_decode_setup_takes_a_context_a_sequence():
    contexts = [5, 40, 17]
    query, kv_cache, tables, moved = bench_attention.decode_setup(3, contexts, torch.device("cpu"), 4)
    element = torch.finfo(bench_attention.DTYPE).bits // 8
    per_token = bench_attention.NUM_KV_HEADS * bench_attention.HEAD_DIM * element * 2
    for block_tables, seq_lens in tables:
        assert seq_lens.tolist() == contexts + [0]
        used = [
            block_tables[row, : -(-length // bench_attention.BLOCK_SIZE)]
            for row, length in enumerate(contexts)
        ]
        assert torch.cat(used).unique().numel() == sum(entry.numel() for entry in used)  # no block shared
    assert moved >= sum(contexts) * per_token
    with pytest.raises(ValueError, match="2 contexts for 3"):
        bench_attention.decode_setup(3, [1, 2], torch.device("cpu"))

"""Micro-benchmark of decode attention and the KV store on CUDA: ms a call, achieved GB/s, and the fraction
of a measured device-to-device copy ceiling, at qwen2.5-1.5b's shapes (12 query heads, 2 KV heads,
head_dim 128, block 16, bf16). `python -m engine.kernels.bench_attention [--json PATH] [--sweep]
[--against FILE]`; `--sweep` also times other tile configurations and split counts, to tune
decode_attention; `--against FILE` times another version of decode_attention.py beside this one
on every case, each at its own choice of splits, alternating (e.g. the one a commit had:
`git show REF:engine/kernels/decode_attention.py > FILE`). The mixed-graph and seed-mix cases also
time planned_decode_attention, the kernel the engine runs there (mixed steps, and steps of
PLANNED_MIN_DECODES decodes or more), beside the one-split-count kernel.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch
import triton

from engine.kernels import decode_attention
from engine.kernels.ceilings import copy_bandwidth_gbs
from engine.kernels.decode_attention import _paged_decode_attention, choose_num_splits
from engine.kernels.kv_cache import store_kv
from engine.kernels.planned_decode_attention import plan_decode, planned_decode_attention, planned_num_splits
from engine.kernels.timing import graph_ms, load_kernel_module

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 12, 2, 128, 16, torch.bfloat16
DECODE_CASES = [(1, 1024), (1, 4096), (64, 1024), (256, 1024), (256, 2048)]  # (batch, context)
# (decodes, context, rows): the decode kernel as a mixed step's CUDA graph launches it, over every row
# the step may decode (min(tokens, max_num_seqs): 257 offline at 256, 1,024 in the server), the rows
# past the decodes empty (context 0), the split count fixed at capture; timed at each of MIXED_SPLITS.
MIXED_CASES = [(128, 1024, 257), (64, 1024, 257), (192, 1024, 257), (128, 1024, 1024)]
MIXED_SPLITS = (1, 2, 3, 4)
# (decodes, rows): a closed loop's decodes at the seed-mix's contexts (prompts of 16 / 64 / 256 / 1,024 /
# 4,096 tokens, 1-256 generated so far, drawn with SEED_MIX_SEED): a hundredfold spread of lengths in
# one step, where uniform contexts have none. rows > decodes: a mixed step's graph; rows == decodes: a
# decode step's. Split counts are each kernel version's own choice for a graph, which serves any length
# up to GRAPH_CONTEXT (the model's longest). The decode steps of 4, 8 and 16 rows place
# PLANNED_MIN_DECODES (engine.attention.triton_backend): below it a decode-only step keeps the one-count
# kernel, from it the planned one; each case times both.
SEED_MIX_CASES = [(128, 257), (128, 128), (256, 257), (64, 257), (4, 4), (8, 8), (16, 16)]
SEED_MIX_PROMPTS = (16, 64, 256, 1024, 4096)
SEED_MIX_SEED = 0
GRAPH_CONTEXT = 32768
STORE_CASES = [1, 256, 8192]  # tokens
# Each timed graph touches at least this many bytes (up to MAX_COPIES calls over distinct blocks), so the
# 50 MB L2 cannot serve a call from the previous one: as in a real step, where 28 layers take turns.
BYTES_PER_GRAPH = 256 * 2**20
MAX_COPIES = 64
ROUNDS, REPLAYS = 7, 10
SWEEP_TILES = [(n, w, s) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def seed_mix_contexts(batch: int, seed: int = SEED_MIX_SEED) -> list[int]:
    """batch contexts of a seed-mix closed loop's decodes: a prompt length and 1-256 tokens generated."""
    generator = random.Random(seed)
    return [generator.choice(SEED_MIX_PROMPTS) + generator.randint(1, 256) for _ in range(batch)]


def decode_setup(
    batch: int, context: int | Sequence[int], device: torch.device, rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, list, int]:
    """(query, kv_cache, per-copy (block_tables, seq_lens), bytes a call moves). context: one for every
    sequence, or one a sequence. The blocks of every copy are drawn from one random permutation of the
    cache, as after a long run of allocations and frees. rows > batch appends empty rows (context 0,
    table of block 0), as a mixed step's graph has."""
    rows = batch if rows is None else rows
    contexts = [context] * batch if isinstance(context, int) else list(context)
    if len(contexts) != batch:
        raise ValueError(f"{len(contexts)} contexts for {batch} sequences")
    element = torch.finfo(DTYPE).bits // 8
    kv_bytes = sum(contexts) * NUM_KV_HEADS * HEAD_DIM * element * 2  # K and V
    blocks = [triton.cdiv(length, BLOCK_SIZE) for length in contexts]
    blocks_per_seq = max(blocks)
    copies = max(1, min(MAX_COPIES, BYTES_PER_GRAPH // kv_bytes))
    num_blocks = copies * sum(blocks)
    kv_cache = torch.randn(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    order = torch.randperm(num_blocks, device=device).to(torch.int32).view(copies, -1)
    seq_lens = torch.zeros(rows, dtype=torch.int32, device=device)
    seq_lens[:batch] = torch.tensor(contexts, dtype=torch.int32, device=device)
    padded = torch.zeros(copies, rows, blocks_per_seq, dtype=torch.int32, device=device)
    used = 0
    for row, count in enumerate(blocks):
        padded[:, row, :count] = order[:, used : used + count]
        used += count
    tables = [(padded[copy].contiguous(), seq_lens) for copy in range(copies)]
    query = torch.randn(rows, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    # + q, out and the block table of the decodes
    moved = kv_bytes + 2 * batch * NUM_HEADS * HEAD_DIM * element + sum(blocks) * 4
    return query, kv_cache, tables, moved


def bench_decode(
    device: torch.device, num_sms: int, ceiling: float, sweep: bool, against: ModuleType | None = None
) -> list[dict]:
    print(f"\npaged_decode_attention: {NUM_HEADS} heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16")
    print(f"{'batch':>6} {'context':>8} {'splits':>6} {'ms':>9} {'GB/s':>8} {'of copy':>8}")
    results = [
        decode_case(batch, context, device, num_sms, ceiling, sweep, against)
        for batch, context in DECODE_CASES
    ]
    torch.cuda.empty_cache()
    return results


def bench_mixed(
    device: torch.device,
    num_sms: int,
    ceiling: float,
    sweep: bool = False,
    against: ModuleType | None = None,
) -> list[dict]:
    """The decode kernel over a mixed graph's rows, some empty, at each split count in MIXED_SPLITS;
    with sweep, the tiles of SWEEP_TILES on the first case too (1 and 2 splits); with against, this
    version and the other at each one's choice of splits for a graph."""
    print("\npaged_decode_attention in a mixed step's graph (rows past the decodes are empty)")
    print(f"{'decodes':>8} {'rows':>5} {'context':>8} {'splits':>6} {'ms':>9} {'GB/s':>8} {'of copy':>8}")
    results = [
        figure
        for index, (batch, context, rows) in enumerate(MIXED_CASES)
        for figure in mixed_case(
            batch, context, rows, device, num_sms, ceiling, sweep and index == 0, against
        )
    ]
    torch.cuda.empty_cache()
    return results


def mixed_case(
    batch: int,
    context: int,
    rows: int,
    device: torch.device,
    num_sms: int,
    ceiling: float,
    sweep: bool = False,
    against: ModuleType | None = None,
) -> list[dict]:
    query, kv_cache, tables, moved = decode_setup(batch, context, device, rows)
    calls_for = decode_calls(query, kv_cache, tables)
    results: list[dict] = []
    for splits in MIXED_SPLITS:
        milliseconds = graph_ms(calls_for(splits, None), ROUNDS, REPLAYS)
        gbps = moved / milliseconds / 1e6
        print(
            f"{batch:>8} {rows:>5} {context:>8} {splits:>6} {milliseconds:>9.4f} {gbps:>8.0f} "
            f"{gbps / ceiling:>8.1%}"
        )
        results.append(
            {"decodes": batch, "rows": rows, "context": context, "num_splits": splits, "ms": milliseconds,
             "bytes": moved, "gbps": gbps, "fraction_of_copy": gbps / ceiling}
        )  # fmt: skip
    graph_splits = choose_num_splits(rows, NUM_KV_HEADS, GRAPH_CONTEXT, num_sms)  # this graph's choice
    results[0]["planned"] = time_planned(
        calls_for(graph_splits, None), (query, kv_cache, tables), batch, moved
    )
    if sweep:  # the tiles at 1 and 2 splits
        results[0]["sweep"] = sweep_decode(calls_for, 1, moved)
    if against is not None:
        results[0]["against"] = time_against(
            calls_for(graph_splits, None),
            (query, kv_cache, tables),
            rows,
            GRAPH_CONTEXT,
            num_sms,
            moved,
            against,
        )
        results[0]["against"]["this_num_splits"] = graph_splits
    return results


def decode_calls(
    query: torch.Tensor, kv_cache: torch.Tensor, tables: list, module: ModuleType = decode_attention
) -> Callable[[int, tuple[int, int, int] | None], list[Callable[[], object]]]:
    """calls_for(splits, tile): one call per copy of the block tables, through `module` (this
    decode_attention, or another version of it); tile None: the public launcher's own choice."""
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5

    def calls_for(splits: int, tile: tuple[int, int, int] | None) -> list[Callable[[], object]]:
        def call(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> Callable[[], object]:
            if tile is None:
                return lambda: module.paged_decode_attention(
                    query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, splits, out=out
                )
            block_n, num_warps, num_stages = tile
            return lambda: _paged_decode_attention(
                query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, splits, out,
                block_n=block_n, num_warps=num_warps, num_stages=num_stages,
            )  # fmt: skip

        return [call(block_tables, seq_lens) for block_tables, seq_lens in tables]

    return calls_for


def bench_seed_mix(
    device: torch.device, num_sms: int, ceiling: float, against: ModuleType | None = None
) -> list[dict]:
    """The decode kernel over SEED_MIX_CASES at this version's choice of splits for a graph; with
    against, the other version at its own choice, alternating, median of 3."""
    print("\npaged_decode_attention at a seed-mix closed loop's contexts (a graph's split choice)")
    print(f"{'decodes':>8} {'rows':>5} {'tokens':>8} {'splits':>6} {'ms':>9} {'GB/s':>8} {'of copy':>8}")
    results = []
    for batch, rows in SEED_MIX_CASES:
        contexts = seed_mix_contexts(batch)
        query, kv_cache, tables, moved = decode_setup(batch, contexts, device, rows)
        splits = choose_num_splits(rows, NUM_KV_HEADS, GRAPH_CONTEXT, num_sms)
        this = decode_calls(query, kv_cache, tables)(splits, None)
        milliseconds = graph_ms(this, ROUNDS, REPLAYS)
        gbps = moved / milliseconds / 1e6
        print(
            f"{batch:>8} {rows:>5} {sum(contexts):>8} {splits:>6} {milliseconds:>9.4f} {gbps:>8.0f} "
            f"{gbps / ceiling:>8.1%}"
        )
        result: dict = {
            "decodes": batch, "rows": rows, "contexts": contexts, "num_splits": splits, "ms": milliseconds,
            "bytes": moved, "gbps": gbps, "fraction_of_copy": gbps / ceiling,
        }  # fmt: skip
        result["planned"] = time_planned(this, (query, kv_cache, tables), batch, moved)
        if against is not None:
            result["against"] = time_against(
                this, (query, kv_cache, tables), rows, GRAPH_CONTEXT, num_sms, moved, against
            )
        results.append(result)
    torch.cuda.empty_cache()
    return results


def alternate_medians(
    first: list[Callable[[], object]], second: list[Callable[[], object]]
) -> tuple[float, float]:
    """Two sets of calls timed alternately three times each (a drift of the GPU's clock falls on both):
    the median ms of each."""
    first_ms, second_ms = [], []
    for _ in range(3):
        first_ms.append(graph_ms(first, ROUNDS, REPLAYS))
        second_ms.append(graph_ms(second, ROUNDS, REPLAYS))
    return statistics.median(first_ms), statistics.median(second_ms)


def time_planned(
    one_count: list[Callable[[], object]],
    setup: tuple[torch.Tensor, torch.Tensor, list],
    decodes: int,
    moved: int,
) -> dict:
    """The planned kernel (what the engine runs for a mixed step's decodes, or 16 or more) over the same
    decode_setup, beside the one-split-count kernel's calls (alternate_medians). Each copy is planned
    once outside the timed calls, as the engine plans once a step for all layers; the plan is timed
    apart. decodes: the rows that hold contexts (the rest of a graph's rows are empty)."""
    query, kv_cache, tables = setup
    out = torch.empty_like(query)
    scale = HEAD_DIM**-0.5
    num_splits = planned_num_splits(GRAPH_CONTEXT)
    plans = [plan_decode(query, seq_lens, num_splits, NUM_KV_HEADS) for _, seq_lens in tables]

    def call(block_tables: torch.Tensor, seq_lens: torch.Tensor, plan) -> Callable[[], object]:
        return lambda: planned_decode_attention(
            query, kv_cache[0], kv_cache[1], block_tables, seq_lens, scale, num_splits, out=out, plan=plan
        )

    planned = [
        call(block_tables, seq_lens, plan)
        for (block_tables, seq_lens), plan in zip(tables, plans, strict=True)
    ]
    mine, theirs = alternate_medians(planned, one_count)
    plan_ms = graph_ms([lambda: plan_decode(query, tables[0][1], num_splits, NUM_KV_HEADS)], ROUNDS, REPLAYS)
    print(
        f"    planned (the engine's kernel here): {mine:.4f} ms, {theirs / mine:.3f}x the one-count kernel's "
        f"{theirs:.4f} ms; its plan {plan_ms:.4f} ms once a step"
    )
    return {
        "decodes": decodes, "num_splits": num_splits, "ms": mine, "gbps": moved / mine / 1e6,
        "one_count_ms": theirs, "speedup": theirs / mine, "plan_ms": plan_ms,
    }  # fmt: skip


def time_against(
    this: list[Callable[[], object]],
    setup: tuple[torch.Tensor, torch.Tensor, list],
    num_seqs: int,
    max_context: int,
    num_sms: int,
    moved: int,
    against: ModuleType,
) -> dict:
    """This version's calls and the other version's over the same decode_setup (query, kv_cache,
    tables), at the other's own choice of splits for num_seqs rows up to max_context, timed alternately
    three times each (a drift of the GPU's clock falls on both); the medians."""
    other_splits = against.choose_num_splits(num_seqs, NUM_KV_HEADS, max_context, num_sms)
    other = decode_calls(*setup, against)(other_splits, None)
    mine, theirs = alternate_medians(this, other)
    print(f"    against {against.__file__}: {theirs:.4f} ms, this {mine:.4f} ms: {theirs / mine:.3f}x")
    return {
        "file": str(against.__file__), "num_splits": other_splits, "ms": theirs,
        "gbps": moved / theirs / 1e6, "this_ms": mine, "speedup": theirs / mine,
    }  # fmt: skip


def decode_case(
    batch: int,
    context: int,
    device: torch.device,
    num_sms: int,
    ceiling: float,
    sweep: bool,
    against: ModuleType | None = None,
) -> dict:
    query, kv_cache, tables, moved = decode_setup(batch, context, device)
    num_splits = choose_num_splits(batch, NUM_KV_HEADS, context, num_sms)
    calls_for = decode_calls(query, kv_cache, tables)
    milliseconds = graph_ms(calls_for(num_splits, None), ROUNDS, REPLAYS)
    gbps = moved / milliseconds / 1e6
    print(f"{batch:>6} {context:>8} {num_splits:>6} {milliseconds:>9.4f} {gbps:>8.0f} {gbps / ceiling:>8.1%}")
    result: dict = {
        "batch": batch,
        "context": context,
        "num_splits": num_splits,
        "ms": milliseconds,
        "bytes": moved,
        "gbps": gbps,
        "fraction_of_copy": gbps / ceiling,
    }
    if sweep:
        result["sweep"] = sweep_decode(calls_for, num_splits, moved)
    if against is not None:
        result["against"] = time_against(
            calls_for(num_splits, None), (query, kv_cache, tables), batch, context, num_sms, moved, against
        )
    return result


def sweep_decode(calls_for: Callable, num_splits: int, moved: int) -> list[dict]:
    """Every (BLOCK_N, num_warps, num_stages) in SWEEP_TILES at 1, the chosen and twice the chosen splits."""
    timed: list[tuple[float, int, tuple[int, int, int]]] = []  # (ms, splits, tile)
    for splits in sorted({1, num_splits, min(2 * num_splits, 32)}):
        for tile in SWEEP_TILES:
            try:
                timed.append((graph_ms(calls_for(splits, tile), ROUNDS, REPLAYS), splits, tile))
            except Exception as error:  # a tile that does not fit (shared memory, registers)
                print(f"    splits {splits} tile {tile}: {type(error).__name__}: {str(error)[:80]}")
    timed.sort()
    for milliseconds, splits, (block_n, num_warps, num_stages) in timed[:5]:
        print(
            f"    sweep: splits {splits:>2} BLOCK_N {block_n:>3} warps {num_warps} stages {num_stages}: "
            f"{milliseconds:.4f} ms, {moved / milliseconds / 1e6:.0f} GB/s"
        )
    return [
        {"splits": splits, "tile": list(tile), "ms": milliseconds, "gbps": moved / milliseconds / 1e6}
        for milliseconds, splits, tile in timed
    ]


def bench_store(device: torch.device, ceiling: float) -> list[dict]:
    print(f"\nstore_kv: {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, bf16, key/value strided views of qkv")
    print(f"{'tokens':>8} {'ms':>9} {'GB/s':>8} {'of copy':>8}")
    results = [store_case(num_tokens, device, ceiling) for num_tokens in STORE_CASES]
    torch.cuda.empty_cache()
    return results


def store_case(num_tokens: int, device: torch.device, ceiling: float) -> dict:
    element = torch.finfo(DTYPE).bits // 8
    kv_bytes = num_tokens * NUM_KV_HEADS * HEAD_DIM * element * 2  # K and V, one way
    copies = max(1, min(MAX_COPIES, BYTES_PER_GRAPH // (2 * kv_bytes)))
    num_blocks = triton.cdiv(copies * num_tokens, BLOCK_SIZE) + 1
    kv_cache = torch.zeros(2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=device)[: copies * num_tokens].view(copies, -1)
    qkv = torch.randn(
        copies, num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=device
    )
    key_start = NUM_HEADS * HEAD_DIM
    value_start = key_start + NUM_KV_HEADS * HEAD_DIM

    def call(copy: int) -> Callable[[], object]:
        # [num_tokens, num_kv_heads, head_dim] strided views, as the attention layer gets them
        key = qkv[copy, :, key_start:value_start].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        value = qkv[copy, :, value_start:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        mapping = slots[copy]
        return lambda: store_kv(key, value, kv_cache[0], kv_cache[1], mapping)

    milliseconds = graph_ms([call(copy) for copy in range(copies)], ROUNDS, REPLAYS)
    moved = 2 * kv_bytes + num_tokens * 8  # read and write K/V, read the slot mapping
    gbps = moved / milliseconds / 1e6
    print(f"{num_tokens:>8} {milliseconds:>9.4f} {gbps:>8.0f} {gbps / ceiling:>8.1%}")
    return {
        "tokens": num_tokens,
        "ms": milliseconds,
        "bytes": moved,
        "gbps": gbps,
        "fraction_of_copy": gbps / ceiling,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.kernels.bench_attention", description=__doc__)
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations and splits")
    parser.add_argument(
        "--against",
        type=Path,
        help="another version of engine/kernels/decode_attention.py, timed beside this one on every case",
    )
    args = parser.parse_args(argv)
    against = load_kernel_module(args.against, "paged_decode_attention") if args.against else None
    if not torch.cuda.is_available():
        print("bench_attention needs a CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 2
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    ceiling = copy_bandwidth_gbs(device)
    print(
        f"{properties.name}, {properties.multi_processor_count} SMs; device-to-device copy: {ceiling:.0f} GB/s"
    )
    figures = {
        "device": properties.name,
        "num_sms": properties.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_gbps": ceiling,
        "decode": bench_decode(device, properties.multi_processor_count, ceiling, args.sweep, against),
        "decode_mixed": bench_mixed(device, properties.multi_processor_count, ceiling, args.sweep, against),
        "decode_seed_mix": bench_seed_mix(device, properties.multi_processor_count, ceiling, against),
        "store_kv": bench_store(device, ceiling),
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

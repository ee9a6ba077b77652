"""Micro-benchmark of paged prefill attention on CUDA at qwen2.5-1.5b's shapes (12 query heads, 2 KV heads,
head_dim 128, block 16, bf16): ms a launch (replayed from a CUDA graph, as the engine runs it), causal
TFLOP/s against a measured bf16 matmul ceiling, and the time of the torch path it replaces (per-sequence
SDPA in a Python loop, as engine/attention/torch_backend.py does).

`python -m engine.kernels.bench_prefill [--json PATH] [--sweep] [--against FILE] [--case TEXT ...]`;
`--sweep` also times other tiles, to tune prefill_attention._default_tile (54 tiles compiled and timed a
case: minutes a case, so `--case 4096` sweeps only the cases whose name holds that text); `--against
FILE` times another version of the kernel's module beside this one on every case, in the same process
(e.g. the one a commit had: `git show REF:engine/kernels/prefill_attention.py > FILE`), so a change is
measured against what it replaces on one GPU.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.kernels.ceilings import matmul_tflops
from engine.kernels.prefill_attention import _paged_prefill_attention, paged_prefill_attention
from engine.kernels.timing import eager_ms, graph_ms, load_kernel_module

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 12, 2, 128, 16, torch.bfloat16
# (name, [(tokens cached before, chunk length)] of one step)
CASES: list[tuple[str, list[tuple[int, int]]]] = [
    ("2 prompts x 4096", [(0, 4096)] * 2),
    ("8 chunks x 1024 @0", [(0, 1024)] * 8),
    ("8 chunks x 1024 @1024", [(1024, 1024)] * 8),
    ("8 chunks x 1024 @3072", [(3072, 1024)] * 8),
    ("16 prompts x 512", [(0, 512)] * 16),
    # A closed loop's mixed steps: one new prompt beside the decodes (too few programs to fill the GPU).
    ("1 prompt x 256", [(0, 256)]),
    ("1 prompt x 1024", [(0, 1024)]),
    ("1 prompt x 4096", [(0, 4096)]),
]
# The torch backend's SDPA choice (flash where it applies; an explicit mask falls to memory-efficient).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
SWEEP_TILES = [(m, n, w, s) for m in (32, 64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]


def _slots(table: torch.Tensor, length: int) -> torch.Tensor:
    """[length] cache slot of each position of one sequence, from its block table row [max_blocks]."""
    positions = torch.arange(length, device=table.device)
    return table[positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE


def kernel_ms(call: Callable[[], object]) -> float:
    """Median milliseconds of a launch of the kernel replayed in a CUDA graph, as the engine's graphs run
    it: no launch overhead, so a small case (one prompt of a few hundred tokens, a few microseconds of
    GPU work) times the kernel, not Python's ~20 us a launch."""
    return graph_ms([call], rounds=5, replays=20)


def torch_path_ms(call: Callable[[], object]) -> float:
    """Median milliseconds of the torch path, launched from Python as the torch backend runs it."""
    return eager_ms(call, repeats=10)


class Step:
    """One prefill step's tensors: a qkv buffer with query/key/value views, the paged cache holding every
    chunk's context (the step's K/V already stored), block tables drawn from a random permutation."""

    def __init__(self, chunks: list[tuple[int, int]], device: torch.device) -> None:
        self.chunks = chunks
        q_lens = [q_len for _, q_len in chunks]
        self.seq_lens_cpu = [cached + q_len for cached, q_len in chunks]
        self.starts_cpu = [0]
        for q_len in q_lens:
            self.starts_cpu.append(self.starts_cpu[-1] + q_len)
        num_tokens = self.starts_cpu[-1]
        self.max_query_len = max(q_lens)
        blocks_per_seq = triton.cdiv(max(self.seq_lens_cpu), BLOCK_SIZE)
        num_blocks = len(chunks) * blocks_per_seq
        self.kv_cache = torch.randn(
            2, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device
        )
        order = torch.randperm(num_blocks, device=device).to(torch.int32)
        self.block_tables = order.view(len(chunks), blocks_per_seq).contiguous()
        # [num_tokens, (num_heads + 2 * num_kv_heads) * head_dim], as the fused qkv projection writes it
        qkv = torch.randn(num_tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM, dtype=DTYPE, device=device)
        key_start, value_start = NUM_HEADS * HEAD_DIM, (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM
        self.query = qkv[:, :key_start].view(num_tokens, NUM_HEADS, HEAD_DIM)
        self.key = qkv[:, key_start:value_start].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        self.value = qkv[:, value_start:].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        # Store the step's K/V at its slots, as store_kv does before attention runs.
        flat = self.kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim]
        for i, (cached, q_len) in enumerate(chunks):
            slots = _slots(self.block_tables[i], cached + q_len)[cached:]
            rows = slice(self.starts_cpu[i], self.starts_cpu[i + 1])
            flat[0][slots] = self.key[rows]
            flat[1][slots] = self.value[rows]
        self.query_start_loc = torch.tensor(self.starts_cpu, dtype=torch.int32, device=device)
        self.seq_lens = torch.tensor(self.seq_lens_cpu, dtype=torch.int32, device=device)
        self.out = torch.empty_like(self.query)
        self.scale = HEAD_DIM**-0.5

    def causal_flops(self) -> int:
        """4 * head_dim * num_heads per (query row, key it attends): QK^T and PV, the causal half only."""
        attended = sum(q_len * cached + q_len * (q_len + 1) // 2 for cached, q_len in self.chunks)
        return 4 * attended * HEAD_DIM * NUM_HEADS

    def run_triton(
        self, tile: tuple[int, int, int, int] | None = None, module: ModuleType | None = None
    ) -> torch.Tensor:
        """This kernel (or `module`'s paged_prefill_attention, another version of it) at its default
        tile, or this kernel at `tile`."""
        args = (
            self.query, self.kv_cache[0], self.kv_cache[1], self.block_tables, self.query_start_loc,
            self.seq_lens, self.scale, self.max_query_len,
        )  # fmt: skip
        if module is not None:
            return module.paged_prefill_attention(*args, out=self.out)
        if tile is None:
            return paged_prefill_attention(*args, out=self.out)
        block_m, block_n, num_warps, num_stages = tile
        return _paged_prefill_attention(
            *args, self.out, block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages
        )

    def run_torch(self) -> torch.Tensor:
        """The torch backend's prefill: per sequence, SDPA on the chunk's own K/V (is_causal) when it starts
        the sequence, else K/V gathered from the cache by slot with an explicit offset causal mask."""
        out = torch.empty_like(self.query)
        flat = self.kv_cache.flatten(1, 2)
        for i, (cached, q_len) in enumerate(self.chunks):
            rows = slice(self.starts_cpu[i], self.starts_cpu[i + 1])
            q = self.query[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
            with sdpa_kernel(SDPA_BACKENDS):
                if cached == 0:
                    k = self.key[rows].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, q_len, dim]
                    v = self.value[rows].transpose(0, 1).unsqueeze(0)
                    result = F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
                    )
                else:
                    context = cached + q_len
                    slots = _slots(self.block_tables[i], context)
                    k = flat[0][slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, context, dim]
                    v = flat[1][slots].transpose(0, 1).unsqueeze(0)
                    positions = torch.arange(q_len, device=q.device)[:, None] + cached
                    mask = torch.arange(context, device=q.device)[None, :] <= positions
                    result = F.scaled_dot_product_attention(
                        q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True
                    )
            out[rows] = result[0].transpose(0, 1)
        return out


def bench_case(
    name: str,
    chunks: list[tuple[int, int]],
    device: torch.device,
    ceiling: float,
    sweep: bool,
    against: ModuleType | None = None,
) -> dict:
    step = Step(chunks, device)
    flops = step.causal_flops()
    difference = (step.run_triton().float() - step.run_torch().float()).abs().max().item()
    triton_ms = kernel_ms(step.run_triton)
    torch_ms = torch_path_ms(step.run_torch)
    tflops = flops / triton_ms / 1e9
    print(
        f"{name:<24} {sum(q for _, q in chunks):>7} {triton_ms:>9.3f} {tflops:>8.1f} "
        f"{tflops / ceiling:>8.1%} {torch_ms:>9.3f} {flops / torch_ms / 1e9:>8.1f} "
        f"{torch_ms / triton_ms:>7.2f}x {difference:>9.2e}"
    )
    result: dict = {
        "case": name,
        "chunks": [list(chunk) for chunk in chunks],
        "causal_flops": flops,
        "triton_ms": triton_ms,
        "triton_tflops": tflops,
        "fraction_of_matmul": tflops / ceiling,
        "torch_ms": torch_ms,
        "torch_tflops": flops / torch_ms / 1e9,
        "speedup": torch_ms / triton_ms,
        "max_abs_difference": difference,
    }
    if against is not None:
        # Timed again beside the other version, alternating, so a drift of the GPU's clock between
        # the two falls on both.
        run_against = functools.partial(step.run_triton, module=against)
        agreement = (step.run_triton().float() - run_against().float()).abs().max().item()
        this_ms, other_ms = [], []
        for _ in range(3):
            this_ms.append(kernel_ms(step.run_triton))
            other_ms.append(kernel_ms(run_against))
        this, other = sorted(this_ms)[1], sorted(other_ms)[1]
        print(
            f"    against {against.__file__}: {other:.3f} ms ({flops / other / 1e9:.1f} TFLOP/s), "
            f"this {this:.3f} ms: {other / this:.3f}x; outputs differ by {agreement:.2e}"
        )
        result["against"] = {
            "file": str(against.__file__),
            "ms": other,
            "tflops": flops / other / 1e9,
            "this_ms": this,
            "speedup": other / this,
            "max_abs_difference": agreement,
        }
    if sweep:
        result["sweep"] = sweep_case(step, flops)
    return result


def select_cases(
    wanted: list[str] | None, cases: list[tuple[str, list[tuple[int, int]]]] = CASES
) -> list[tuple[str, list[tuple[int, int]]]]:
    """The cases whose name contains any of `wanted` (all of them for None or an empty list), in their
    order; a text that names no case is an error listing the names, so a typo does not silently time
    nothing."""
    if not wanted:
        return list(cases)
    unmatched = [text for text in wanted if not any(text in name for name, _ in cases)]
    if unmatched:
        names = ", ".join(repr(name) for name, _ in cases)
        raise ValueError(f"--case {unmatched[0]!r} matches no case; the cases: {names}")
    return [(name, chunks) for name, chunks in cases if any(text in name for text in wanted)]


def sweep_case(step: Step, flops: int) -> list[dict]:
    """Every (BLOCK_M, BLOCK_N, num_warps, num_stages) in SWEEP_TILES; prints the five fastest."""
    timed: list[tuple[float, tuple[int, int, int, int]]] = []
    for tile in SWEEP_TILES:
        try:
            timed.append((kernel_ms(functools.partial(step.run_triton, tile)), tile))
            # each tile as it is timed: a sweep cut short by a time limit still shows what it measured
            print(f"    tile {tile}: {timed[-1][0]:.3f} ms", flush=True)
        except Exception as error:  # a tile that does not fit (shared memory, registers)
            print(f"    tile {tile}: {type(error).__name__}: {str(error)[:80]}")
    timed.sort()
    for milliseconds, (block_m, block_n, num_warps, num_stages) in timed[:5]:
        print(
            f"    sweep: BLOCK_M {block_m:>3} BLOCK_N {block_n:>3} warps {num_warps} stages {num_stages}: "
            f"{milliseconds:.3f} ms, {flops / milliseconds / 1e9:.1f} TFLOP/s"
        )
    return [
        {"tile": list(tile), "ms": milliseconds, "tflops": flops / milliseconds / 1e9}
        for milliseconds, tile in timed
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.kernels.bench_prefill", description=__doc__)
    parser.add_argument("--json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--sweep", action="store_true", help="also time other tile configurations")
    parser.add_argument(
        "--against",
        type=Path,
        help="another version of engine/kernels/prefill_attention.py, timed beside this one on every case",
    )
    parser.add_argument(
        "--case",
        action="append",
        metavar="TEXT",
        help="only the cases whose name contains TEXT (repeatable), e.g. --case 4096",
    )
    args = parser.parse_args(argv)
    try:
        selected = select_cases(args.case)
    except ValueError as error:
        parser.error(str(error))
    against = load_kernel_module(args.against, "paged_prefill_attention") if args.against else None
    if not torch.cuda.is_available():
        print("bench_prefill needs a CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 2
    device = torch.device("cuda")
    properties = torch.cuda.get_device_properties(device)
    ceiling = matmul_tflops(device)
    print(f"{properties.name}, {properties.multi_processor_count} SMs; bf16 matmul: {ceiling:.0f} TFLOP/s")
    print(
        f"\npaged_prefill_attention: {NUM_HEADS} heads, {NUM_KV_HEADS} KV heads, head_dim {HEAD_DIM}, "
        f"block {BLOCK_SIZE}, bf16; TFLOP/s count the causal half only"
    )
    print(
        f"{'case':<24} {'tokens':>7} {'ms':>9} {'TFLOP/s':>8} {'of mm':>8} "
        f"{'torch ms':>9} {'TFLOP/s':>8} {'speedup':>8} {'max diff':>9}"
    )
    cases = [bench_case(name, chunks, device, ceiling, args.sweep, against) for name, chunks in selected]
    figures = {
        "device": properties.name,
        "num_sms": properties.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "matmul_tflops": ceiling,
        "prefill": cases,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Micro-benchmark of the skinny matmul (engine.kernels.gemv) against cuBLAS at decode batch sizes.

`python -m engine.kernels.bench_gemv [--json PATH] [--sweep]`: qwen2.5-1.5b's projections in bf16 on
CUDA (qkv with bias, o, gate_up, and down with the MLP activation applied to its input, which for cuBLAS
is the activation kernel plus the matmul), at 1 to 16 rows. Each call reads a different copy of the
weight, more than the L2 cache holds in all, as a decode step does (28 layers between two reads of one
layer's weights), replayed from a CUDA graph; GB/s counts the weight bytes. `--sweep` times a grid of
tiles at 1 and 4 rows and prints the best per shape, for gemv.TUNED.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.kernels.activation import silu_and_mul
from engine.kernels.ceilings import copy_bandwidth_gbs
from engine.kernels.gemv import MAX_ROWS, GemvConfig, choose_config, gemv
from engine.kernels.timing import graph_ms

HIDDEN, INTERMEDIATE, QKV = 1536, 8960, 2048  # qwen2.5-1.5b: 12 + 2 * 2 heads of 128
DTYPE = torch.bfloat16
ROWS = (1, 2, 4, 8, 16)
L2_BYTES = 50 << 20
# (name, N, K, bias, silu_mul_input)
SHAPES = [
    ("qkv_proj", QKV, HIDDEN, True, False),
    ("o_proj", HIDDEN, HIDDEN, False, False),
    ("gate_up_proj", 2 * INTERMEDIATE, HIDDEN, False, False),
    ("down_proj+act", HIDDEN, INTERMEDIATE, False, True),
]
SWEEP = [
    GemvConfig(block_n, block_k, split_k, num_warps, num_stages)
    for block_n, block_k, split_k, num_warps, num_stages in itertools.product(
        (16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (4,), (3,)
    )
]


@dataclass
class Result:
    shape: str
    rows: int
    weight_bytes: int
    gemv_us: float
    cublas_us: float
    gemv_gbps: float
    cublas_gbps: float
    config: dict


class Operands:
    """Enough copies of one projection's weight that cycling through them misses L2 every time."""

    def __init__(self, n: int, k: int, bias: bool, silu: bool, device: torch.device) -> None:
        self.weight_bytes = n * k * DTYPE.itemsize
        copies = max(4, min(32, -(-4 * L2_BYTES // self.weight_bytes)))
        self.weights = [torch.randn(n, k, dtype=DTYPE, device=device) * k**-0.5 for _ in range(copies)]
        self.bias = torch.randn(n, dtype=DTYPE, device=device) if bias else None
        self.silu = silu
        self.k = k
        self.device = device

    def inputs(self, rows: int) -> torch.Tensor:
        width = 2 * self.k if self.silu else self.k
        return torch.randn(rows, width, dtype=DTYPE, device=self.device)

    def calls(
        self, rows: int, config: GemvConfig | None
    ) -> tuple[Callable[[], object], Callable[[], object]]:
        """(gemv over the next copy, cuBLAS over the next copy): each call moves on to another copy."""
        x = self.inputs(rows)
        gemv_copies = itertools.cycle(self.weights)
        cublas_copies = itertools.cycle(self.weights)

        def with_gemv() -> object:
            return gemv(x, next(gemv_copies), self.bias, silu_mul_input=self.silu, config=config, check=False)

        def with_cublas() -> object:
            activated = silu_and_mul(x) if self.silu else x
            return F.linear(activated, next(cublas_copies), self.bias)

        return with_gemv, with_cublas


def measure(operands: Operands, rows: int, config: GemvConfig | None) -> tuple[float, float]:
    """(gemv us, cuBLAS us) a call, each replayed from a graph of one call per weight copy."""
    with_gemv, with_cublas = operands.calls(rows, config)
    calls = len(operands.weights)
    return (
        1000 * graph_ms([with_gemv] * calls),
        1000 * graph_ms([with_cublas] * calls),
    )


def run(rows_list: tuple[int, ...], device: torch.device) -> list[Result]:
    results = []
    num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    for name, n, k, bias, silu in SHAPES:
        operands = Operands(n, k, bias, silu, device)
        for rows in rows_list:
            gemv_us, cublas_us = measure(operands, rows, None)
            config = choose_config(n, k, silu, num_sms)
            result = Result(
                shape=name,
                rows=rows,
                weight_bytes=operands.weight_bytes,
                gemv_us=gemv_us,
                cublas_us=cublas_us,
                gemv_gbps=operands.weight_bytes / gemv_us / 1e3,
                cublas_gbps=operands.weight_bytes / cublas_us / 1e3,
                config=asdict(config),
            )
            results.append(result)
            print(
                f"{name:<16}{rows:>5}{gemv_us:>10.2f}{cublas_us:>10.2f}{cublas_us / gemv_us:>8.2f}x"
                f"{result.gemv_gbps:>9.0f}{result.cublas_gbps:>9.0f}   {config}",
                flush=True,
            )
        del operands
        torch.cuda.empty_cache()
    return results


def sweep(device: torch.device, rows_list: tuple[int, ...] = (1, 4)) -> dict[str, list[dict]]:
    """Every SWEEP tile for every shape: the times, and the best per shape (summed over rows_list)."""
    found: dict[str, list[dict]] = {}
    for name, n, k, bias, silu in SHAPES:
        operands = Operands(n, k, bias, silu, device)
        rows_times: list[dict[str, Any]] = []
        for config in SWEEP:
            if config.split_k > 1 and k // config.split_k < config.block_k:
                continue
            times = []
            for rows in rows_list:
                with_gemv, _ = operands.calls(rows, config)
                times.append(1000 * graph_ms([with_gemv] * len(operands.weights)))
            rows_times.append({"config": asdict(config), "us": times, "total_us": sum(times)})
        rows_times.sort(key=lambda entry: entry["total_us"])
        found[name] = rows_times
        best = rows_times[0]
        print(f"{name:<16} best {best['config']}: {best['us']} us at rows {rows_list}", flush=True)
        print(f"    ({n}, {k}, {silu}): GemvConfig(**{best['config']}),", flush=True)
        del operands
        torch.cuda.empty_cache()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the skinny matmul against cuBLAS on CUDA.")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS), help=f"row counts (<= {MAX_ROWS})")
    parser.add_argument("--sweep", action="store_true", help="also time a grid of tiles per shape")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemv needs a CUDA device (it times GPU kernels); none is visible here.", file=sys.stderr)
        return 1
    device = torch.device("cuda")
    ceiling = copy_bandwidth_gbs(device)
    print(f"{torch.cuda.get_device_name()}, {DTYPE}, copy ceiling {ceiling:.0f} GB/s")
    print(f"{'shape':<16}{'rows':>5}{'gemv us':>10}{'cuBLAS':>10}{'speedup':>9}{'GB/s':>9}{'cuBLAS':>9}")
    report: dict[str, object] = {"gpu": torch.cuda.get_device_name(), "copy_ceiling_gbs": ceiling}
    with torch.inference_mode():
        report["results"] = [asdict(r) for r in run(tuple(args.rows), device)]
        if args.sweep:
            report["sweep"] = sweep(device)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(report, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

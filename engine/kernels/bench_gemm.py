"""What one layer's dense projections cost per token as a step carries more rows (cuBLAS, bf16, CUDA).

`python -m engine.kernels.bench_gemm [--rows 128,256,...] [--json PATH]`: qwen2.5-1.5b's four projections
(qkv without its bias, o, gate_up, down) as `F.linear` at each row count, each replayed
20 times from a CUDA graph (engine.kernels.timing), and the layer's microseconds, nanoseconds a token and
TFLOP/s. Why: a step's rows are its decodes plus its prompt chunks; whether a scheduling change that puts
more prompt rows into fewer steps can pay depends on how much cheaper a token gets as the rows grow (on an
H100 the cost a token stops falling near 768 rows: 140 ns a layer at 1,152 rows, 135 at 4,224).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from engine.kernels.bench_gemv import HIDDEN, INTERMEDIATE, QKV
from engine.kernels.timing import graph_ms

DTYPE = torch.bfloat16
# (name, N, K): one layer's projections, as engine.models.llama runs them
SHAPES = (
    ("qkv_proj", QKV, HIDDEN),
    ("o_proj", HIDDEN, HIDDEN),
    ("gate_up_proj", 2 * INTERMEDIATE, HIDDEN),
    ("down_proj", HIDDEN, INTERMEDIATE),
)
# 128 decodes alone, then with prompt chunks of 256 to ~8,192 tokens beside them
DEFAULT_ROWS = (128, 160, 256, 384, 512, 768, 1152, 1664, 2176, 3200, 4224, 6272, 8320)
CALLS_PER_GRAPH = 20


@dataclass(frozen=True)
class LayerCost:
    rows: int
    projection_us: dict[str, float]
    layer_us: float
    ns_per_token: float
    tflops: float


def layer_cost(rows: int, projection_us: dict[str, float]) -> LayerCost:
    """The layer's total, its cost a token (row) and the FLOP rate it reaches (2 * rows * N * K a
    projection)."""
    layer_us = sum(projection_us.values())
    flops = 2 * rows * sum(n * k for _, n, k in SHAPES)
    return LayerCost(rows, projection_us, layer_us, 1e3 * layer_us / rows, flops / (layer_us * 1e-6) / 1e12)


def time_projections(rows: int, device: torch.device) -> dict[str, float]:
    """Microseconds a call of each projection at `rows` rows."""
    times = {}
    for name, n, k in SHAPES:
        x = torch.randn(rows, k, device=device, dtype=DTYPE)
        weight = torch.randn(n, k, device=device, dtype=DTYPE)
        call = functools.partial(F.linear, x, weight)
        times[name] = 1e3 * graph_ms([call] * CALLS_PER_GRAPH)
    return times


def parse_rows(text: str) -> tuple[int, ...]:
    rows = tuple(int(part) for part in text.split(",") if part.strip())
    if not rows or min(rows) < 1:
        raise argparse.ArgumentTypeError(f"--rows wants positive integers separated by commas, got {text!r}")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.kernels.bench_gemm", description=__doc__)
    parser.add_argument("--rows", type=parse_rows, default=DEFAULT_ROWS, help="row counts, comma-separated")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gemm times cuBLAS on a CUDA device; none is available here", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    costs = []
    for rows in args.rows:
        cost = layer_cost(rows, time_projections(rows, device))
        costs.append(cost)
        parts = " ".join(f"{name} {us:.1f}" for name, us in cost.projection_us.items())
        print(
            f"rows {rows:5d}: layer {cost.layer_us:8.1f} us, {cost.ns_per_token:7.2f} ns a token, "
            f"{cost.tflops:6.1f} TFLOP/s ({parts} us)",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(),
                    "torch": torch.__version__,
                    "rows": [asdict(c) for c in costs],
                },
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Micro-benchmark of the elementwise kernels (norm, rotary, activation) against their torch references.

`python -m engine.kernels.bench_elementwise [--json PATH]`: qwen2.5-1.5b shapes in bf16 on CUDA, at
1, 64, 256 and 8192 tokens. Each op is timed replayed from a CUDA graph (device time, as the decode step
sees it) and launched eagerly; GB/s counts the bytes each op must move, against a measured copy ceiling.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton

from engine.kernels.activation import silu_and_mul
from engine.kernels.ceilings import copy_bandwidth_gbs
from engine.kernels.norm import fused_add_rms_norm, rms_norm
from engine.kernels.reference import (
    fused_add_rms_norm_reference,
    reference_cos_sin,
    rms_norm_reference,
    rotate_reference,
    silu_and_mul_reference,
)
from engine.kernels.rotary import apply_rotary
from engine.kernels.timing import eager_ms, graph_ms

# qwen2.5-1.5b
HIDDEN = 1536
INTERMEDIATE = 8960
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 12, 2, 128
MAX_POSITIONS = 32768
EPS = 1e-6
DTYPE = torch.bfloat16
TOKEN_COUNTS = (1, 64, 256, 8192)
CALLS_PER_GRAPH = 20  # the same call repeated: warm caches, as a step's small tensors are
EAGER_REPEATS = 100


@dataclass
class Result:
    op: str
    num_tokens: int
    bytes_moved: int
    kernel_graph_us: float
    reference_graph_us: float
    kernel_eager_us: float
    reference_eager_us: float
    kernel_gbps: float
    reference_gbps: float
    kernel_fraction_of_ceiling: float


def cases(num_tokens: int) -> list[tuple[str, int, Callable[[], object], Callable[[], object]]]:
    """(op, bytes it must move, kernel call, torch reference call) for one token count."""
    device = torch.device("cuda")
    size = DTYPE.itemsize
    x = torch.randn(num_tokens, HIDDEN, dtype=DTYPE, device=device)
    residual = torch.randn(num_tokens, HIDDEN, dtype=DTYPE, device=device)
    weight = torch.rand(HIDDEN, dtype=DTYPE, device=device) + 0.5
    normed = torch.empty_like(x)
    q_size, kv_size = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, dtype=DTYPE, device=device)
    query = qkv[:, :q_size].view(num_tokens, NUM_HEADS, HEAD_DIM)
    key = qkv[:, q_size : q_size + kv_size].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, HEAD_DIM, 2, device=device).float() / HEAD_DIM))
    freqs = torch.outer(torch.arange(MAX_POSITIONS, device=device, dtype=torch.float32), inv_freq)
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    positions = torch.randint(0, MAX_POSITIONS, (num_tokens,), device=device)
    # The model computes cos/sin once a step for all layers: the per-layer reference is the rotation.
    cos, sin = reference_cos_sin(cos_sin, positions, DTYPE)
    gate_up = torch.randn(num_tokens, 2 * INTERMEDIATE, dtype=DTYPE, device=device)
    activated = torch.empty(num_tokens, INTERMEDIATE, dtype=DTYPE, device=device)
    rows = num_tokens * HIDDEN * size
    heads = num_tokens * (NUM_HEADS + NUM_KV_HEADS) * HEAD_DIM * size
    return [
        (
            "rms_norm",
            2 * rows + HIDDEN * size,
            lambda: rms_norm(x, weight, EPS, out=normed),
            lambda: rms_norm_reference(x, weight, EPS),
        ),
        (
            "fused_add_rms_norm",
            4 * rows + HIDDEN * size,  # reads x and residual, writes both
            lambda: fused_add_rms_norm(x, residual, weight, EPS),
            lambda: fused_add_rms_norm_reference(x, residual, weight, EPS),
        ),
        (
            "rotary",
            2 * heads + num_tokens * (HEAD_DIM * 4 + 8),  # q and k read and written, a cos/sin row each
            lambda: apply_rotary(query, key, cos_sin, positions),
            lambda: rotate_reference(query, key, cos, sin),
        ),
        (
            "silu_and_mul",
            3 * num_tokens * INTERMEDIATE * size,
            lambda: silu_and_mul(gate_up, out=activated),
            lambda: silu_and_mul_reference(gate_up),
        ),
    ]


def run(token_counts: tuple[int, ...], ceiling: float) -> list[Result]:
    """Time every op at every token count, printing each row as it is measured."""
    results = []
    with torch.inference_mode():
        for num_tokens in token_counts:
            for op, bytes_moved, kernel, reference in cases(num_tokens):
                kernel_graph = 1000 * graph_ms([kernel] * CALLS_PER_GRAPH)
                reference_graph = 1000 * graph_ms([reference] * CALLS_PER_GRAPH)
                kernel_gbps = bytes_moved / (kernel_graph * 1e-6) / 1e9
                results.append(
                    Result(
                        op=op,
                        num_tokens=num_tokens,
                        bytes_moved=bytes_moved,
                        kernel_graph_us=kernel_graph,
                        reference_graph_us=reference_graph,
                        kernel_eager_us=1000 * eager_ms(kernel, EAGER_REPEATS),
                        reference_eager_us=1000 * eager_ms(reference, EAGER_REPEATS),
                        kernel_gbps=kernel_gbps,
                        reference_gbps=bytes_moved / (reference_graph * 1e-6) / 1e9,
                        kernel_fraction_of_ceiling=kernel_gbps / ceiling,
                    )
                )
                print_row(results[-1])
            torch.cuda.empty_cache()
    return results


def print_row(result: Result) -> None:
    print(
        f"{result.op:<20}{result.num_tokens:>7}"
        f"{result.kernel_graph_us:>10.2f}{result.reference_graph_us:>10.2f}"
        f"{result.reference_graph_us / result.kernel_graph_us:>8.1f}x"
        f"{result.kernel_eager_us:>10.2f}{result.reference_eager_us:>10.2f}"
        f"{result.kernel_gbps:>9.0f}{result.reference_gbps:>9.0f}{100 * result.kernel_fraction_of_ceiling:>7.0f}%",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the elementwise Triton kernels against torch on CUDA.")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKEN_COUNTS), help="token counts")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_elementwise needs a CUDA device (it times GPU kernels); none is visible here.",
            file=sys.stderr,
        )
        return 1
    device_name = torch.cuda.get_device_name()
    print(
        f"{device_name}, {DTYPE}, hidden {HIDDEN}, intermediate {INTERMEDIATE}, {NUM_HEADS}/{NUM_KV_HEADS} heads of {HEAD_DIM}"
    )
    print(
        "graph: microseconds a call replayed from a CUDA graph; eager: launched from Python; GB/s from graph times"
    )
    ceiling = copy_bandwidth_gbs(torch.device("cuda"))
    print(f"copy ceiling (1 GiB device-to-device, read + write): {ceiling:.0f} GB/s")
    print(
        f"{'op':<20}{'tokens':>7}{'graph us':>10}{'torch':>10}{'speedup':>9}"
        f"{'eager us':>10}{'torch':>10}{'GB/s':>9}{'torch':>9}{'of max':>8}"
    )
    results = run(tuple(args.tokens), ceiling)
    if args.json:
        report = {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "dtype": str(DTYPE),
            "shapes": {
                "hidden": HIDDEN,
                "intermediate": INTERMEDIATE,
                "num_heads": NUM_HEADS,
                "num_kv_heads": NUM_KV_HEADS,
                "head_dim": HEAD_DIM,
            },
            "copy_ceiling_gbps": ceiling,
            "results": [asdict(result) for result in results],
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

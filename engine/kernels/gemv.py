"""Skinny matmul for decode steps of a few sequences: out = x @ weight.T (+ bias), x of at most 16 rows.

Why: at batch 1 a decode step is the weights streamed once, and cuBLAS's small-M kernels stream the
projections of one layer at 0.75-3.2 TB/s on an H200 (o_proj 6.3 us for 4.7 MB; down_proj 11.2 us
for 27.5 MB, with a split-K reduce kernel after it), while the card copies at 4.2 TB/s. This kernel
tiles the weight's rows, splits K across programs when the rows alone would not fill the GPU, and
lets the last program of each row tile add the partial sums (a counter per tile, reset by that program,
so CUDA-graph replays find it at zero): one launch, no reduce kernel. It can also apply the MLP's
silu(gate) * up to its input as it loads it (rounded as the activation kernel rounds), which removes
the activation kernel from the step, and adds a bias in float32 before the one rounding, as cuBLAS's
bias epilogue does.

The model calls `gemv` through engine.models.kernels for projections of at most `MAX_ROWS` rows;
larger batches go to cuBLAS, which is at the bandwidth ceiling there. Tile sizes per weight shape come
from `python -m engine.kernels.bench_gemv --sweep` on the H200 (see `choose_config`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from engine.kernels.activation import silu_mul
from engine.kernels.ceilings import num_sms

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_ROWS = 16  # x rows one program covers: the smallest tensor-core tile
# The model sends projections of at most this many rows here (measured against cuBLAS, bench_gemv).
FASTER_THAN_CUBLAS_ROWS = 8
COUNTERS = 1 << 16  # row tiles a split-K launch may use (N / BLOCK_N); 64 Ki tiles of 16 rows = 1 Mi rows
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True)
class GemvConfig:
    block_n: int  # weight rows (output columns) a program computes
    block_k: int  # K a loop step loads
    split_k: int  # programs sharing one row tile's K; 1 = no split
    num_warps: int = 4
    num_stages: int = 3


@triton.jit
def _gemv_kernel(
    x_ptr,  # [num_rows, K] (or [num_rows, 2K]: gate then up, with SILU_MUL)
    weight_ptr,  # [N, K], row stride weight_row_stride
    bias_ptr,  # [N] or a dummy
    out_ptr,  # [num_rows, N]
    partial_ptr,  # [SPLIT_K, BLOCK_M, N] float32 (split-K only)
    counter_ptr,  # [>= cdiv(N, BLOCK_N)] int32, zero between launches (split-K only)
    num_rows,
    x_row_stride,
    weight_row_stride,
    out_row_stride,
    N: tl.constexpr,
    K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,  # a multiple of BLOCK_K
    HAS_BIAS: tl.constexpr,
    SILU_MUL: tl.constexpr,
    TORCH_EXP: tl.constexpr,
    IEEE_DOT: tl.constexpr,  # float32 inputs: full-precision products, not tf32
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < num_rows
    col_mask = cols < N
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_first = split * K_PER_SPLIT
    for k_offset in range(0, K_PER_SPLIT, BLOCK_K):
        ks = k_first + k_offset + tl.arange(0, BLOCK_K)
        k_mask = ks < K
        weight = tl.load(
            weight_ptr + cols[:, None].to(tl.int64) * weight_row_stride + ks[None, :],
            mask=col_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        x_ptrs = x_ptr + rows[:, None] * x_row_stride + ks[None, :]
        x_mask = row_mask[:, None] & k_mask[None, :]
        if SILU_MUL:
            gate = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptrs + K, mask=x_mask, other=0.0).to(tl.float32)
            x = silu_mul(gate, up, dtype, TORCH_EXP)
        else:
            x = tl.load(x_ptrs, mask=x_mask, other=0.0)
        if IEEE_DOT:
            acc += tl.dot(x, tl.trans(weight), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(weight))
    out_ptrs = out_ptr + rows[:, None] * out_row_stride + cols[None, :]
    out_mask = row_mask[:, None] & col_mask[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(dtype), mask=out_mask)
    else:
        # Every program leaves its partial sums; the one that arrives last at this tile's counter adds
        # them in split order (deterministic), writes the output and resets the counter for the next launch.
        partial_ptrs = partial_ptr + (split * BLOCK_M + rows[:, None]) * N + cols[None, :]
        tl.store(partial_ptrs, acc, mask=col_mask[None, :])
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT_K - 1:
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for other in tl.static_range(SPLIT_K):
                total += tl.load(
                    partial_ptr + (other * BLOCK_M + rows[:, None]) * N + cols[None, :],
                    mask=col_mask[None, :],
                    other=0.0,
                    cache_modifier=".cg",  # written by other programs: read from L2, not a stale L1
                )
            if HAS_BIAS:
                total += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(dtype), mask=out_mask)
            tl.atomic_xchg(counter_ptr + tile, 0)


# Measured on the H200 (bf16, `bench_gemv --sweep`, weights read from HBM as in a step), keyed by
# (N, K, silu_mul_input): the best tiles where they beat cuBLAS at 1-4 rows, None where cuBLAS is as fast
# or faster. Shapes not listed are not measured: the model leaves them to cuBLAS (`wins`).
TUNED: dict[tuple[int, int, bool], GemvConfig | None] = {
    (2048, 1536, False): None,  # qwen2.5-1.5b qkv_proj: 5.21 us, cuBLAS 5.20
    (1536, 1536, False): GemvConfig(32, 512, 1),  # o_proj: 4.78 us, cuBLAS 6.51
    (17920, 1536, False): GemvConfig(64, 128, 1),  # gate_up_proj: 16.1 us, cuBLAS 17.5
    (1536, 8960, True): None,  # down_proj with the activation: the fused input runs slowly (PERFORMANCE.md)
}


def wins(n: int, k: int, silu_mul_input: bool = False) -> bool:
    """Whether the skinny matmul was measured faster than cuBLAS for a weight of this shape."""
    return TUNED.get((n, k, silu_mul_input)) is not None


def choose_config(n: int, k: int, silu_mul_input: bool, num_sms: int) -> GemvConfig:
    """Tiles for a weight of n rows and k columns: the measured entry, else enough programs to fill
    the GPU about twice (split K when the row tiles alone are fewer), each loading 512-byte row runs."""
    tuned = TUNED.get((n, k, silu_mul_input))
    if tuned is not None:
        return tuned
    block_n, block_k = 32, 256
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    while tiles * split_k < 2 * num_sms and k // (2 * split_k) >= 2 * block_k and split_k < 8:
        split_k *= 2
    return GemvConfig(block_n, block_k, split_k)


_counters: dict[torch.device, torch.Tensor] = {}


def _counters_for(device: torch.device) -> torch.Tensor:
    """The device's split-K counters, zero between launches (each launch resets the ones it used).

    Launches on one stream run one after another, so they can share them; allocated on first use,
    before any CUDA graph capture (the model's warm-up pass runs first)."""
    counters = _counters.get(device)
    if counters is None:
        counters = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
        _counters[device] = counters
    return counters


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu_mul_input: bool = False,
    config: GemvConfig | None = None,
    out: torch.Tensor | None = None,
    check: bool = True,
) -> torch.Tensor:
    """x @ weight.T (+ bias) for x of at most MAX_ROWS rows; with silu_mul_input, x is [rows, 2K]
    (gate, then up) and the product takes silu(gate) * up, rounded to the dtype, as its input.

    weight: [N, K], last dim contiguous (nn.Linear's layout). Returns out [rows, N] in x's dtype.
    check=False skips the argument checks (the model's hot path, tensors it built itself).
    """
    rows = x.shape[0]
    n, k = weight.shape
    if check:
        _check(x, weight, bias, silu_mul_input, out)
    if out is None:
        out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    device_index = x.device.index or 0
    if config is None:
        # The interpreter runs programs one after another: on CPU, no split.
        config = choose_config(n, k, silu_mul_input, num_sms(device_index) if x.is_cuda else 1)
    block_k = config.block_k
    k_per_split = triton.cdiv(triton.cdiv(k, config.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)  # no program without K to cover
    tiles = triton.cdiv(n, config.block_n)
    if split_k > 1:
        partial = torch.empty((split_k, MAX_ROWS, n), dtype=torch.float32, device=x.device)
        counters = _counters_for(x.device)
        if tiles > counters.numel():
            raise ValueError(f"weight of {n} rows needs {tiles} split-K counters, more than {COUNTERS}")
    else:
        partial = counters = out  # unused
    _gemv_kernel[(tiles, split_k)](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        partial,
        counters,
        rows,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        N=n,
        K=k,
        K_PER_SPLIT=k_per_split,
        HAS_BIAS=bias is not None,
        SILU_MUL=silu_mul_input,
        TORCH_EXP=x.is_cuda and not INTERPRETED,
        IEEE_DOT=x.dtype == torch.float32,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=block_k,
        SPLIT_K=split_k,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


def _check(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    silu_mul_input: bool,
    out: torch.Tensor | None,
) -> None:
    if x.dim() != 2 or weight.dim() != 2:
        raise ValueError(f"x and weight must be 2-D, got shapes {tuple(x.shape)} and {tuple(weight.shape)}")
    if x.dtype not in SUPPORTED_DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"x and weight must share a dtype of {SUPPORTED_DTYPES}, got {x.dtype}, {weight.dtype}"
        )
    if x.shape[0] > MAX_ROWS:
        raise ValueError(f"gemv takes at most {MAX_ROWS} rows, got {x.shape[0]}: use a matmul")
    n, k = weight.shape
    expected = 2 * k if silu_mul_input else k
    if x.shape[1] != expected:
        what = "2 * K (gate, then up)" if silu_mul_input else "K"
        raise ValueError(
            f"x has {x.shape[1]} columns, expected {what} = {expected} for weight {tuple(weight.shape)}"
        )
    for name, tensor in (("x", x), ("weight", weight)):
        if tensor.shape[1] > 1 and tensor.stride(1) != 1:
            raise ValueError(f"{name} must have a contiguous last dim, got strides {tensor.stride()}")
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device}, expected {x.device}")
    if bias is not None and (bias.shape != (n,) or bias.dtype != x.dtype or bias.device != x.device):
        raise ValueError(
            f"bias must be [{n}] of {x.dtype} on {x.device}, got {tuple(bias.shape)} {bias.dtype}"
        )
    if out is not None and (
        out.shape != (x.shape[0], n) or out.dtype != x.dtype or out.device != x.device or out.stride(1) != 1
    ):
        raise ValueError(f"out must be [{x.shape[0]}, {n}] of {x.dtype} on {x.device}, contiguous rows")

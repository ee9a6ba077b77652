"""Sampling kernels: the fused Gumbel-max draw over whole rows, and the nucleus (top-p) cutoff by
bisection. The sampler (engine/sampler.py) calls them on CUDA; engine/kernels/sampling_reference.py
is their torch reference, which the CPU engine runs and the tests compare with token for token.

`sample_rows`: one program a row walks the vocabulary in blocks, keeps the tokens at or above the
row's cutoff, adds temperature x Gumbel noise hashed from (key, position, token index) and keeps the
running argmax, so a draw reads the logits once and writes one token: no sort, no probabilities, no
generator state. A row of temperature 0 takes the plain argmax (lowest index on ties, as torch).

`top_p_cutoffs`: for the rows flagged `needs`, the largest logit t whose tokens at or above it hold
top_p of the row's mass (softmax at the row's temperature, over the tokens >= lower), found by
bisection over the float32 bit patterns of the logits: at most 32 passes over the row, no sort. Rows
not flagged are skipped at once, so the sampler can send it only the rows a cheaper method could not
settle, without knowing on the host which those are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Block of vocabulary entries a program handles at a time: 16 KiB of float32 logits.
MAX_BLOCK = 4096


@triton.jit
def _mix32(x):
    """lowbias32 on uint32 (as sampling_reference.mix32): shifts are logical, products wrap."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _gumbel(state, index):
    """Standard Gumbel noise of (row state, vocabulary index), as sampling_reference.gumbel_noise."""
    bits = _mix32(state + index.to(tl.uint32) * 0x9E3779B9)
    uniform = ((bits >> 9).to(tl.float32) * 2.0 + 1.0) * 5.9604644775390625e-08  # odd multiples of 2^-24
    return -tl.log(-tl.log(uniform))


@triton.jit
def _sample_kernel(
    logits_ptr,  # [rows, vocab] float32, row stride logits_stride
    temperature_ptr,  # [rows] float32, stride param_stride (0: argmax)
    key_lo_ptr,  # [rows] int32 bit patterns, stride param_stride
    key_hi_ptr,  # [rows] int32
    position_ptr,  # [rows] int32: the token's index in its request's output
    cutoff_ptr,  # [rows] float32, contiguous; unused unless HAS_CUTOFF
    out_ptr,  # [rows] int64
    logits_stride,
    param_stride,
    vocab,
    HAS_CUTOFF: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * logits_stride
    temperature = tl.load(temperature_ptr + row * param_stride)
    position = tl.load(position_ptr + row * param_stride).to(tl.uint32, bitcast=True)
    key_hi = tl.load(key_hi_ptr + row * param_stride).to(tl.uint32, bitcast=True)
    key_lo = tl.load(key_lo_ptr + row * param_stride).to(tl.uint32, bitcast=True)
    state = _mix32(position ^ 0x5BD1E995)
    state = _mix32(state ^ key_hi)
    state = _mix32(state ^ key_lo)
    cutoff = float("-inf")
    if HAS_CUTOFF:
        cutoff = tl.load(cutoff_ptr + row)
    cols = tl.arange(0, BLOCK)
    best = tl.full((), float("-inf"), tl.float32)
    best_index = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        index = start + cols
        logit = tl.load(base + index, mask=index < vocab, other=float("-inf"))
        score = logit
        if temperature > 0.0:
            score = logit + temperature * _gumbel(state, index)
        if HAS_CUTOFF:
            score = tl.where(logit >= cutoff, score, float("-inf"))
        block_best = tl.max(score, axis=0)
        block_index = tl.argmax(score, axis=0, tie_break_left=True)
        # Strictly greater: an earlier block's equal maximum has the lower index, as torch.argmax.
        best_index = tl.where(block_best > best, start + block_index, best_index)
        best = tl.maximum(best, block_best)
    tl.store(out_ptr + row, best_index.to(tl.int64))


@triton.jit
def _ordered(value):
    """float32 -> int64 key with the same order (negative floats: magnitude bits flipped)."""
    bits = value.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _from_ordered(key):
    """The inverse of _ordered: an int64 key in int32 range -> its float32."""
    bits = key.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _mass_at_or_above(base, threshold, top, temperature, vocab, BLOCK: tl.constexpr):
    """sum of exp((logit - top) / temperature) over the row's logits >= threshold."""
    cols = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        index = start + cols
        logit = tl.load(base + index, mask=index < vocab, other=float("-inf"))
        weight = tl.exp((logit - top) / temperature)
        total += tl.where(logit >= threshold, weight, 0.0)
    return tl.sum(total, axis=0)


@triton.jit
def _top_p_bisect_kernel(
    logits_ptr,  # [*, vocab] float32, row stride logits_stride
    rows_ptr,  # [n] int32: the logits row of each entry
    temperature_ptr,  # [n] float32 (> 0)
    top_p_ptr,  # [n] float32
    lower_ptr,  # [n] float32: min-p's cutoff, -inf when off
    needs_ptr,  # [n] int32: 0 skips the entry (its cutoff is left as it is)
    cutoff_ptr,  # [n] float32, written where needs
    logits_stride,
    vocab,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    if tl.load(needs_ptr + entry) != 0:
        row = tl.load(rows_ptr + entry).to(tl.int64)
        base = logits_ptr + row * logits_stride
        temperature = tl.load(temperature_ptr + entry)
        lower = tl.load(lower_ptr + entry)
        cols = tl.arange(0, BLOCK)
        top_block = tl.full((BLOCK,), float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            index = start + cols
            top_block = tl.maximum(top_block, tl.load(base + index, mask=index < vocab, other=float("-inf")))
        top = tl.max(top_block, axis=0)
        target = tl.load(top_p_ptr + entry) * _mass_at_or_above(base, lower, top, temperature, vocab, BLOCK)
        # Invariant: the mass at or above `low` reaches target (true at min-p's cutoff, which keeps
        # the whole candidate mass); above `high` it does not. The answer is a logit: the mass only
        # changes at logit values.
        low = _ordered(lower)
        high = _ordered(top)
        while low < high:
            middle = low + (high - low + 1) // 2
            if _mass_at_or_above(base, _from_ordered(middle), top, temperature, vocab, BLOCK) >= target:
                low = middle
            else:
                high = middle - 1
        tl.store(cutoff_ptr + entry, _from_ordered(low))


def _check(
    name: str, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, like: torch.Tensor
) -> None:
    if tuple(tensor.shape) != shape:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {shape}")
    if tensor.dtype != dtype:
        raise ValueError(f"{name} has dtype {tensor.dtype}, expected {dtype}")
    if tensor.device != like.device:
        raise ValueError(f"{name} is on {tensor.device}, expected {like.device}")


def _check_logits(logits: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.shape[1] == 0:
        raise ValueError(f"logits must be [rows, vocab] with vocab > 0, got shape {tuple(logits.shape)}")
    if logits.dtype != torch.float32:
        raise ValueError(f"logits has dtype {logits.dtype}, expected torch.float32")
    if logits.shape[1] > 1 and logits.stride(1) != 1:
        raise ValueError(f"logits must have a contiguous last dim, got strides {logits.stride()}")


def _block(vocab: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(vocab), MAX_BLOCK)
    return block, min(max(block // 512, 1), 8)


def sample_rows(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    key_lo: torch.Tensor,
    key_hi: torch.Tensor,
    position: torch.Tensor,
    cutoff: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One token per row, as sampling_reference.sample_reference.

    logits: [rows, vocab] float32, last dim contiguous. temperature [rows] float32; key_lo, key_hi,
    position [rows] int32; these four may be strided views (columns of one parameter table) but must
    share one stride. cutoff: [rows] float32 contiguous, or None. out: [rows] int64 or None.
    """
    _check_logits(logits)
    rows, vocab = logits.shape
    _check("temperature", temperature, (rows,), torch.float32, logits)
    for name, tensor in (("key_lo", key_lo), ("key_hi", key_hi), ("position", position)):
        _check(name, tensor, (rows,), torch.int32, logits)
        if rows > 1 and tensor.stride(0) != temperature.stride(0):
            raise ValueError(f"{name} has stride {tensor.stride(0)}, temperature {temperature.stride(0)}")
    if cutoff is not None:
        _check("cutoff", cutoff, (rows,), torch.float32, logits)
        if rows > 1 and cutoff.stride(0) != 1:
            raise ValueError("cutoff must be contiguous")
    if out is None:
        out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    else:
        _check("out", out, (rows,), torch.int64, logits)
    if rows == 0:
        return out
    block, num_warps = _block(vocab)
    _sample_kernel[(rows,)](
        logits,
        temperature,
        key_lo,
        key_hi,
        position,
        cutoff if cutoff is not None else temperature,
        out,
        logits.stride(0),
        temperature.stride(0),
        vocab,
        HAS_CUTOFF=cutoff is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    return out


def top_p_cutoffs(
    logits: torch.Tensor,
    rows: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    lower: torch.Tensor,
    needs: torch.Tensor,
    cutoff: torch.Tensor,
) -> None:
    """Write into cutoff[i], for each i with needs[i] != 0, the nucleus cutoff of logits[rows[i]]
    (as sampling_reference.top_p_cutoffs_reference, up to the float32 order of summation).

    logits: [*, vocab] float32, last dim contiguous. rows, needs: [n] int32; temperature (> 0),
    top_p, lower: [n] float32; cutoff: [n] float32, written in place. All contiguous.
    """
    _check_logits(logits)
    n = rows.shape[0] if rows.dim() == 1 else -1
    for name, tensor, dtype in (
        ("rows", rows, torch.int32),
        ("needs", needs, torch.int32),
        ("temperature", temperature, torch.float32),
        ("top_p", top_p, torch.float32),
        ("lower", lower, torch.float32),
        ("cutoff", cutoff, torch.float32),
    ):
        _check(name, tensor, (max(n, 0),), dtype, logits)
        if n > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if n <= 0:
        return
    block, num_warps = _block(logits.shape[1])
    _top_p_bisect_kernel[(n,)](
        logits,
        rows,
        temperature,
        top_p,
        lower,
        needs,
        cutoff,
        logits.stride(0),
        logits.shape[1],
        BLOCK=block,
        num_warps=num_warps,
    )

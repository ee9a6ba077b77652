"""Sampling kernels: the fused Gumbel-max draw, penalties, the row mass, and the nucleus (top-p)
cutoff by a k-ary search. The sampler (engine/sampler.py) calls them on CUDA; engine/kernels/
sampling_reference.py is their torch reference, which the CPU engine runs and the tests compare with.

`sample_rows`: each row is split into chunks of the vocabulary, a program a chunk (so that even one
row fills the GPU: 8 us at batch 1 on the H200, against 104 us for one program a row); a program keeps
the tokens at or above the row's cutoff, adds temperature x Gumbel noise hashed from (key, position,
token index) and keeps a running argmax per lane; a second small kernel merges the chunks. A draw
reads the logits once and writes one token: no sort, no probabilities, no generator state. A row of
temperature 0 takes the plain argmax (lowest index on ties, as torch).

`apply_penalties_in_place`: repetition, presence and frequency penalties from the count rows, in one
pass over the penalized rows. `row_masses`: softmax's denominator of rows, split like the draw.

`top_p_cutoffs`: for the rows flagged `needs`, the largest logit t whose tokens at or above it hold
top_p of the row's mass (softmax at the row's temperature, over the tokens >= lower), found by a
k-ary search over the float32 bit patterns of the logits, one program a row: a pass over the row
finds its largest logit, then each pass weighs BISECT_THRESHOLDS (16) candidate cutoffs at once and
narrows the interval 16-fold, so 1 + ceil(32 / 4) = 9 passes at most, no sort (a bisection took
about 34). Rows not flagged are skipped at once, so the sampler can send it only the rows a cheaper
method could not settle, without knowing on the host which those are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.sampling_reference import OUTPUT_COUNT_MASK

# Vocabulary entries a program handles at a time: 4 KiB of float32 logits for the draw and the row
# mass. The top-p search (one program a row, at most 9 passes over it) weighs BISECT_THRESHOLDS
# cutoffs a pass, about two instructions a logit each. Its running sums are a
# [BISECT_THRESHOLDS, BISECT_BLOCK] float32 tile: 64 registers a thread at 16 warps (4 logits a
# thread; about 110 registers in all for sm_90, no spills), and 16 warps give the row's SM other
# warps to run while some wait on their loads.
SAMPLE_BLOCK = 1024
BISECT_BLOCK = 2048
BISECT_THRESHOLDS = 16  # the k of the k-ary search: 8 passes narrow 2^32 keys to one


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
    best_score_ptr,  # [rows, num_chunks] float32: each chunk's best score (unused if ONE_CHUNK)
    best_index_ptr,  # [rows, num_chunks] int32: and its token
    out_ptr,  # [rows] int64, written directly if ONE_CHUNK
    logits_stride,
    param_stride,
    vocab,
    chunk_size,  # a multiple of BLOCK
    num_chunks,
    HAS_CUTOFF: tl.constexpr,
    ONE_CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
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
    first = chunk * chunk_size
    end = tl.minimum(first + chunk_size, vocab)
    cols = tl.arange(0, BLOCK)
    # Each lane keeps its own best (scores, then their tokens) over the chunk; one reduction at the
    # end. A lane sees its tokens in increasing order and replaces only on a strictly greater score,
    # so it keeps the lowest index of its maximum; an all -inf lane keeps its first token, so an
    # all -inf chunk answers its first token, as torch.argmax.
    best = tl.full((BLOCK,), float("-inf"), tl.float32)
    best_index = first + cols
    for start in range(first, end, BLOCK):
        index = start + cols
        logit = tl.load(base + index, mask=index < end, other=float("-inf"))
        score = logit
        if temperature > 0.0:
            score = logit + temperature * _gumbel(state, index)
        if HAS_CUTOFF:
            score = tl.where(logit >= cutoff, score, float("-inf"))
        take = score > best
        best = tl.where(take, score, best)
        best_index = tl.where(take, index, best_index)
    top = tl.max(best, axis=0)
    token = tl.min(tl.where(best == top, best_index, vocab), axis=0)
    if ONE_CHUNK:
        tl.store(out_ptr + row, token.to(tl.int64))
    else:
        tl.store(best_score_ptr + row * num_chunks + chunk, top)
        tl.store(best_index_ptr + row * num_chunks + chunk, token)


@triton.jit
def _merge_chunks_kernel(
    best_score_ptr,  # [rows, num_chunks] float32
    best_index_ptr,  # [rows, num_chunks] int32
    out_ptr,  # [rows] int64
    num_chunks,
    vocab,
    CHUNKS: tl.constexpr,  # next power of two >= num_chunks
):
    """The best of each row's chunks; on equal scores the lowest token (chunks hold ascending tokens)."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.arange(0, CHUNKS)
    mask = chunk < num_chunks
    score = tl.load(best_score_ptr + row * num_chunks + chunk, mask=mask, other=float("-inf"))
    index = tl.load(best_index_ptr + row * num_chunks + chunk, mask=mask, other=vocab)
    top = tl.max(score, axis=0)
    tl.store(out_ptr + row, tl.min(tl.where(score == top, index, vocab), axis=0).to(tl.int64))


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
def _thresholds(low, high, K: tl.constexpr):
    """[K] int64 keys from low up: low + ceil((high - low) * j / K) for j = 0..K-1. They ascend, the
    first is low itself, all lie in [low, high], and when high - low < K they are every key of
    [low, high]. (high - low) * j < 2^32 * K: no int64 overflow."""
    j = tl.arange(0, K).to(tl.int64)
    return low + ((high - low) * j + (K - 1)) // K


@triton.jit
def _masses_at_or_above(base, thresholds, top, scale, vocab, BLOCK: tl.constexpr):
    """[K] float32: for each of the [K] float32 thresholds, the sum of 2^((logit - top) * scale)
    over the row's logits >= it; scale = log2(e) / T, so each term is exp((logit - top) / T), with
    one multiply and the hardware's exp2, once a logit for all K thresholds.

    The running sums are a [K, BLOCK] tile, thresholds along the first axis so that a thread holds
    all K sums of its logits, reduced once at the end. Every threshold's sum adds the same terms in
    the same order (a term is its weight or 0), so equal thresholds get equal sums and a higher one
    never a larger sum. fma(weight, logit >= t, sum) adds exactly what a select and an add would
    (weights lie in [0, 1]: the product is exact), in two instructions a threshold (a set and a
    fused multiply-add, whatever the compiler's fusion default) instead of three."""
    cols = tl.arange(0, BLOCK)
    total = tl.zeros((thresholds.shape[0], BLOCK), tl.float32)
    for start in range(0, vocab, BLOCK):
        index = start + cols
        logit = tl.load(base + index, mask=index < vocab, other=float("-inf"))
        weight = tl.exp2((logit - top) * scale)
        total = tl.fma(weight[None, :], (logit[None, :] >= thresholds[:, None]).to(tl.float32), total)
    return tl.sum(total, axis=1)


@triton.jit
def _narrow(keys, masses, target, high, K: tl.constexpr):
    """The next (low, high) after a pass that weighed keys (from _thresholds: keys[0] is low).
    low: the largest key whose mass reaches target (keys[0], by the invariant, if no other does);
    high: the next key, minus one, or high itself after the last key."""
    j = tl.arange(0, K)
    last = tl.max(tl.where((masses >= target) | (j == 0), j, 0), axis=0)
    low = tl.sum(tl.where(j == last, keys, 0), axis=0)
    above = tl.sum(tl.where(j == last + 1, keys, 0), axis=0)
    # above > low when last < K - 1, since equal keys get equal masses; the maximum only makes sure.
    return low, tl.where(last == K - 1, high, tl.maximum(above - 1, low))


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
    K: tl.constexpr,  # keys weighed a pass (a power of two, at least 2)
    BLOCK: tl.constexpr,
):
    """The nucleus cutoff of each flagged entry's row by a K-ary search (named for the sampler's
    "bisect" method, which calls it; it bisected before it searched K-ary)."""
    entry = tl.program_id(0)
    if tl.load(needs_ptr + entry) != 0:
        row = tl.load(rows_ptr + entry).to(tl.int64)
        base = logits_ptr + row * logits_stride
        scale = 1.4426950408889634 / tl.load(temperature_ptr + entry)
        lower = tl.load(lower_ptr + entry)
        cols = tl.arange(0, BLOCK)
        top_block = tl.full((BLOCK,), float("-inf"), tl.float32)
        for start in range(0, vocab, BLOCK):
            index = start + cols
            top_block = tl.maximum(top_block, tl.load(base + index, mask=index < vocab, other=float("-inf")))
        top = tl.max(top_block, axis=0)
        # K-ary search over the float32 order of [lower, top] for the largest key whose mass (tokens
        # at or above it) reaches target: a logit, since the mass only changes at logit values.
        # Invariant: the answer is in [low, high], and the mass at low reaches target. A pass weighs
        # K keys from low up (_thresholds) and keeps the interval between the last that reaches
        # target and the next: high - low drops to at most (high - low) // K, so from fewer than
        # 2^32 keys at most ceil(32 / log2(K)) passes (8 at K = 16) reach low == high.
        low = _ordered(lower)
        high = tl.maximum(_ordered(top), low)  # lower above top: the answer is lower, as it was
        # The first pass also weighs the row: its first key is lower itself, so masses[0] is the
        # mass of the tokens >= lower, of which target is top_p.
        keys = _thresholds(low, high, K)
        masses = _masses_at_or_above(base, _from_ordered(keys), top, scale, vocab, BLOCK)
        target = tl.load(top_p_ptr + entry) * tl.sum(tl.where(tl.arange(0, K) == 0, masses, 0.0), axis=0)
        low, high = _narrow(keys, masses, target, high, K)
        while low < high:
            keys = _thresholds(low, high, K)
            masses = _masses_at_or_above(base, _from_ordered(keys), top, scale, vocab, BLOCK)
            low, high = _narrow(keys, masses, target, high, K)
        tl.store(cutoff_ptr + entry, _from_ordered(low))


@triton.jit
def _row_mass_kernel(
    logits_ptr,  # [*, vocab] float32, row stride logits_stride
    rows_ptr,  # [n] int32: the logits row of each entry
    top_ptr,  # [n] float32: the row's largest logit
    temperature_ptr,  # [n] float32 (> 0)
    lower_ptr,  # [n] float32: count only logits >= lower
    partial_ptr,  # [n, num_chunks] float32: each chunk's sum
    logits_stride,
    vocab,
    chunk_size,  # a multiple of BLOCK
    num_chunks,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + tl.load(rows_ptr + entry).to(tl.int64) * logits_stride
    scale = 1.4426950408889634 / tl.load(temperature_ptr + entry)
    top = tl.load(top_ptr + entry)
    lower = tl.load(lower_ptr + entry)
    first = chunk * chunk_size
    end = tl.minimum(first + chunk_size, vocab)
    cols = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(first, end, BLOCK):
        index = start + cols
        logit = tl.load(base + index, mask=index < end, other=float("-inf"))
        total += tl.where(logit >= lower, tl.exp2((logit - top) * scale), 0.0)
    tl.store(partial_ptr + entry * num_chunks + chunk, tl.sum(total, axis=0))


@triton.jit
def _penalties_kernel(
    logits_ptr,  # [rows, vocab] float32, row stride logits_stride: penalized in place
    counts_ptr,  # [pool, vocab] int32, row stride counts_stride: PROMPT_FLAG | output count
    batch_rows_ptr,  # [n] int32: the logits rows to penalize
    count_rows_ptr,  # [n] int32: their count rows
    presence_ptr,  # [rows] float32, stride param_stride, read at the batch row
    frequency_ptr,  # [rows] float32
    repetition_ptr,  # [rows] float32
    logits_stride,
    counts_stride,
    param_stride,
    vocab,
    chunk_size,  # a multiple of BLOCK
    OUTPUT_COUNT_MASK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    row = tl.load(batch_rows_ptr + entry).to(tl.int64)
    logits_row = logits_ptr + row * logits_stride
    counts_row = counts_ptr + tl.load(count_rows_ptr + entry).to(tl.int64) * counts_stride
    presence = tl.load(presence_ptr + row * param_stride)
    frequency = tl.load(frequency_ptr + row * param_stride)
    repetition = tl.load(repetition_ptr + row * param_stride)
    first = chunk * chunk_size
    end = tl.minimum(first + chunk_size, vocab)
    cols = tl.arange(0, BLOCK)
    for start in range(first, end, BLOCK):
        index = start + cols
        mask = index < end
        logit = tl.load(logits_row + index, mask=mask, other=0.0)
        count = tl.load(counts_row + index, mask=mask, other=0)
        output = count & OUTPUT_COUNT_MASK
        # div_rn: IEEE division, as torch's (Triton's `/` may round differently).
        penalized = tl.where(logit > 0, tl.math.div_rn(logit, repetition), logit * repetition)
        logit = tl.where(count != 0, penalized, logit)
        logit = logit - frequency * output.to(tl.float32) - presence * (output > 0).to(tl.float32)
        tl.store(logits_row + index, logit, mask=mask)


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


def _block(vocab: int, largest: int) -> tuple[int, int]:
    block = min(triton.next_power_of_2(vocab), largest)
    return block, min(max(block // 256, 1), 8)


def _programs_wanted(device: torch.device) -> int:
    """Programs that fill the device a few times over: a row's vocabulary is split to reach it."""
    if device.type != "cuda":
        return 4  # the interpreter: a few chunks a row, to test the merge
    return 4 * torch.cuda.get_device_properties(device).multi_processor_count


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
    block, num_warps = _block(vocab, SAMPLE_BLOCK)
    # Split each row into chunks of whole blocks so that rows x chunks programs fill the device: one
    # program a row would leave most of it idle at small batches (and walk 151,936 tokens alone).
    num_chunks = min(max(_programs_wanted(logits.device) // rows, 1), triton.cdiv(vocab, block))
    chunk_size = triton.cdiv(triton.cdiv(vocab, num_chunks), block) * block
    num_chunks = triton.cdiv(vocab, chunk_size)
    one_chunk = num_chunks == 1
    best_score = (
        out if one_chunk else torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    )
    best_index = out if one_chunk else torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
    _sample_kernel[(rows, num_chunks)](
        logits,
        temperature,
        key_lo,
        key_hi,
        position,
        cutoff if cutoff is not None else temperature,
        best_score,
        best_index,
        out,
        logits.stride(0),
        temperature.stride(0),
        vocab,
        chunk_size,
        num_chunks,
        HAS_CUTOFF=cutoff is not None,
        ONE_CHUNK=one_chunk,
        BLOCK=block,
        num_warps=num_warps,
    )
    if not one_chunk:
        _merge_chunks_kernel[(rows,)](
            best_score, best_index, out, num_chunks, vocab, CHUNKS=triton.next_power_of_2(num_chunks)
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
    (as sampling_reference.top_p_cutoffs_reference, up to the float32 order of summation), by a
    k-ary search over the float32 order of [lower, top], one program a row: one pass over the row
    for its largest logit, then passes that each weigh BISECT_THRESHOLDS cutoffs (the first also
    the row's mass), 9 passes in all at most (ceil(32 / log2(16)) = 8 of them searching).

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
    block, _ = _block(logits.shape[1], BISECT_BLOCK)  # its own warps: 4 logits a thread, below
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
        K=BISECT_THRESHOLDS,
        BLOCK=block,
        num_warps=min(max(block // 128, 1), 16),  # 4 logits a thread: 4 x K running sums
    )


def row_masses(
    logits: torch.Tensor,
    rows: torch.Tensor,
    top: torch.Tensor,
    temperature: torch.Tensor,
    lower: torch.Tensor,
) -> torch.Tensor:
    """[n] float32: for each i, the sum of exp((logit - top[i]) / temperature[i]) over the logits of
    row rows[i] that are >= lower[i] (softmax's denominator over what min-p keeps), as
    sampling_reference.row_masses_reference up to the order of summation.

    logits: [*, vocab] float32, last dim contiguous; rows [n] int32; top, temperature (> 0), lower
    [n] float32; all contiguous. Each row is split over several programs, as in sample_rows.
    """
    _check_logits(logits)
    n = rows.shape[0] if rows.dim() == 1 else -1
    for name, tensor, dtype in (
        ("rows", rows, torch.int32),
        ("top", top, torch.float32),
        ("temperature", temperature, torch.float32),
        ("lower", lower, torch.float32),
    ):
        _check(name, tensor, (max(n, 0),), dtype, logits)
        if n > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    vocab = logits.shape[1]
    block, num_warps = _block(vocab, SAMPLE_BLOCK)
    num_chunks = min(max(_programs_wanted(logits.device) // max(n, 1), 1), triton.cdiv(vocab, block))
    chunk_size = triton.cdiv(triton.cdiv(vocab, num_chunks), block) * block
    num_chunks = triton.cdiv(vocab, chunk_size)
    partial = torch.empty(max(n, 0), num_chunks, dtype=torch.float32, device=logits.device)
    if n > 0:
        _row_mass_kernel[(n, num_chunks)](
            logits,
            rows,
            top,
            temperature,
            lower,
            partial,
            logits.stride(0),
            vocab,
            chunk_size,
            num_chunks,
            BLOCK=block,
            num_warps=num_warps,
        )
    return partial.sum(dim=-1)


def apply_penalties_in_place(
    logits: torch.Tensor,
    counts: torch.Tensor,
    batch_rows: torch.Tensor,
    count_rows: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> None:
    """logits[batch_rows[i]] = sampling_reference.apply_penalties of that row with counts[count_rows[i]],
    in place, in one pass (the torch reference takes a dozen over [rows, vocab] temporaries).

    logits: [rows, vocab] float32, last dim contiguous; counts: [pool, vocab] int32, last dim
    contiguous; batch_rows, count_rows: [n] int32 contiguous, batch rows distinct; presence,
    frequency, repetition: [rows] float32, read at the batch rows, possibly strided views sharing
    one stride (columns of one parameter table).
    """
    _check_logits(logits)
    rows, vocab = logits.shape
    if counts.dim() != 2 or counts.shape[1] != vocab or counts.dtype != torch.int32:
        raise ValueError(f"counts must be [pool, {vocab}] int32, got {tuple(counts.shape)} {counts.dtype}")
    if counts.device != logits.device or (vocab > 1 and counts.stride(1) != 1):
        raise ValueError("counts must be on the logits' device, with a contiguous last dim")
    n = batch_rows.shape[0] if batch_rows.dim() == 1 else -1
    for name, tensor in (("batch_rows", batch_rows), ("count_rows", count_rows)):
        _check(name, tensor, (max(n, 0),), torch.int32, logits)
        if n > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    for name, tensor in (("presence", presence), ("frequency", frequency), ("repetition", repetition)):
        _check(name, tensor, (rows,), torch.float32, logits)
        if rows > 1 and tensor.stride(0) != presence.stride(0):
            raise ValueError(f"{name} has stride {tensor.stride(0)}, presence {presence.stride(0)}")
    if n <= 0:
        return
    block, num_warps = _block(vocab, SAMPLE_BLOCK)
    num_chunks = min(max(_programs_wanted(logits.device) // n, 1), triton.cdiv(vocab, block))
    chunk_size = triton.cdiv(triton.cdiv(vocab, num_chunks), block) * block
    _penalties_kernel[(n, triton.cdiv(vocab, chunk_size))](
        logits,
        counts,
        batch_rows,
        count_rows,
        presence,
        frequency,
        repetition,
        logits.stride(0),
        counts.stride(0),
        presence.stride(0),
        vocab,
        chunk_size,
        OUTPUT_COUNT_MASK=OUTPUT_COUNT_MASK,
        BLOCK=block,
        num_warps=num_warps,
    )

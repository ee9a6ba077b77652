"""Sampling kernels: the fused Gumbel-max draw, penalties, the row mass, and the nucleus (top-p)
cutoff by a k-ary search. The sampler (engine/sampler.py) calls them on CUDA; engine/kernels/
sampling_reference.py is their torch reference, which the CPU engine runs and the tests compare with.

The kernels that walk the vocabulary split each row into chunks, a program a chunk, so that rows x
chunks programs fill the GPU at any batch size (one program a row leaves most of it idle at small
batches and walks 151,936 tokens alone). Since the chunk count follows the row count, it is passed
unspecialized (do_not_specialize) and no constexpr depends on it: a kernel's compiled variants are
the same at every batch size, so a warm-up at one row and at many compiles them all, and no JIT
compile lands in the middle of serving.

`sample_rows`: a program keeps the tokens of its chunk at or above the row's cutoff, adds temperature
x Gumbel noise hashed from (key, position, token index) and keeps a running argmax per lane; a second
small kernel merges the chunks (8 us at batch 1 on the H200, against 104 us for one program a row). A
draw reads the logits once and writes one token: no sort, no probabilities, no generator state. A row
of temperature 0 takes the plain argmax (lowest index on ties, as torch).

`apply_penalties_in_place`: repetition, presence and frequency penalties from the count rows, in one
pass over the penalized rows. `row_masses`: softmax's denominator of rows.

`top_p_cutoffs`: for the rows flagged `needs`, the largest logit t whose tokens at or above it hold
top_p of the row's mass (softmax at the row's temperature, over the tokens >= lower), found by a
k-ary search over the float32 bit patterns of the logits in [lower, the row's largest logit]: each
pass weighs BISECT_THRESHOLDS (16) candidate cutoffs at once and narrows the interval 16-fold, so
ceil(32 / 4) = 8 passes at most, no sort (a bisection took about 34). A pass is a launch over every
chunk of every row, each program first narrowing with the previous pass's masses of all the row's
chunks: no atomics, no grid-wide barrier, no host sync (graph-capturable); 40 / 187 / 633 us at 1 /
64 / 256 rows of 151,936 logits on the H200 from a CUDA graph, against 459 / 467 / 1277 us for one
program a row. Rows not flagged are skipped at once, so the sampler can send it only the rows a
cheaper method could not settle, without knowing on the host which those are.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels.sampling_reference import OUTPUT_COUNT_MASK

# Vocabulary entries a program handles at a time: 4 KiB of float32 logits for the draw and the row
# mass. The top-p search weighs BISECT_THRESHOLDS cutoffs a logit, about two instructions each, in
# each pass; its running sums are a [BISECT_THRESHOLDS, BISECT_BLOCK] float32 tile, 64 registers a
# thread at 4 logits a thread (BISECT_BLOCK // 128 warps). At 512 (4 warps) a program takes 96
# registers on sm_90 with no spills, so five fit an SM and a row's chunks spread over all of them:
# 186 us at 64 rows on the H200, against 205 us at 1024 (8 warps, two programs an SM) and 309 us at
# 2048 (16 warps).
SAMPLE_BLOCK = 1024
BISECT_BLOCK = 512
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


@triton.jit(do_not_specialize=["chunk_blocks", "num_chunks"])
def _sample_kernel(
    logits_ptr,  # [rows, vocab] float32, row stride logits_stride
    temperature_ptr,  # [rows] float32, stride param_stride (0: argmax)
    key_lo_ptr,  # [rows] int32 bit patterns, stride param_stride
    key_hi_ptr,  # [rows] int32
    position_ptr,  # [rows] int32: the token's index in its request's output
    cutoff_ptr,  # [rows] float32, contiguous; unused unless HAS_CUTOFF
    best_score_ptr,  # [rows, num_chunks] float32: each chunk's best score (unused if one chunk)
    best_index_ptr,  # [rows, num_chunks] int32: and its token
    out_ptr,  # [rows] int64, written directly if one chunk
    logits_stride,
    param_stride,
    vocab,
    chunk_blocks,  # BLOCKs a chunk (the last may hold fewer)
    num_chunks,
    HAS_CUTOFF: tl.constexpr,
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
    first = chunk * chunk_blocks * BLOCK  # a multiple of BLOCK, which the compiler sees: wide loads
    end = tl.minimum(first + chunk_blocks * BLOCK, vocab)
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
    if num_chunks == 1:  # a runtime branch, not a constexpr: the same variant at every batch size
        tl.store(out_ptr + row, token.to(tl.int64))
    else:
        tl.store(best_score_ptr + row * num_chunks + chunk, top)
        tl.store(best_index_ptr + row * num_chunks + chunk, token)


@triton.jit(do_not_specialize=["num_chunks"])
def _merge_chunks_kernel(
    best_score_ptr,  # [rows, num_chunks] float32
    best_index_ptr,  # [rows, num_chunks] int32
    out_ptr,  # [rows] int64
    num_chunks,
    vocab,
    CHUNKS: tl.constexpr,  # a power of two >= any row's chunk count: from the vocabulary, not the rows
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
def _masses_at_or_above(base, thresholds, top, scale, first, end, BLOCK: tl.constexpr):
    """[K] float32: for each of the [K] float32 thresholds, the sum of 2^((logit - top) * scale)
    over the logits of base[first:end] >= it; scale = log2(e) / T, so each term is
    exp((logit - top) / T), with one multiply and the hardware's exp2, once a logit for all K.

    The running sums are a [K, BLOCK] tile, thresholds along the first axis so that a thread holds
    all K sums of its logits, reduced once at the end. Every threshold's sum adds the same terms in
    the same order (a term is its weight or 0), so equal thresholds get equal sums and a higher one
    never a larger sum. fma(weight, logit >= t, sum) adds exactly what a select and an add would
    (weights lie in [0, 1]: the product is exact), in two instructions a threshold (a set and a
    fused multiply-add, whatever the compiler's fusion default) instead of three."""
    cols = tl.arange(0, BLOCK)
    total = tl.zeros((thresholds.shape[0], BLOCK), tl.float32)
    # Three blocks' loads in flight while it weighs one (186 us at 64 rows on the H200, 228 without).
    for start in tl.range(first, end, BLOCK, num_stages=4):
        index = start + cols
        logit = tl.load(base + index, mask=index < end, other=float("-inf"))
        weight = tl.exp2((logit - top) * scale)
        total = tl.fma(weight[None, :], (logit[None, :] >= thresholds[:, None]).to(tl.float32), total)
    return tl.sum(total, axis=1)


@triton.jit
def _row_masses_at_keys(partial, num_chunks, K: tl.constexpr, CHUNKS: tl.constexpr):
    """[K] float32: one pass's masses of a row, its chunks' [num_chunks, K] partial masses (at
    `partial`) summed. Every program that calls this on the same partials (all of them run this one
    compiled kernel) gets the same bits, and a column's sum adds the same chunks in the same order
    whatever its key, so the row's masses keep the order of its chunks' masses."""
    chunk = tl.arange(0, CHUNKS)[:, None]
    masses = tl.load(partial + chunk * K + tl.arange(0, K)[None, :], mask=chunk < num_chunks, other=0.0)
    return tl.sum(masses, axis=0)


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


@triton.jit(do_not_specialize=["chunk_blocks", "num_chunks", "pass_index"])
def _top_p_pass_kernel(
    logits_ptr,  # [*, vocab] float32, row stride logits_stride
    rows_ptr,  # [n] int32: the logits row of each entry
    top_ptr,  # [n] float32: the row's largest logit
    temperature_ptr,  # [n] float32 (> 0)
    top_p_ptr,  # [n] float32
    lower_ptr,  # [n] float32: min-p's cutoff, -inf when off
    needs_ptr,  # [n] int32: 0 skips the entry (its cutoff is left as it is)
    cutoff_ptr,  # [n] float32, written where needs by the last launch
    target_ptr,  # [n] float32: the mass the search looks for, stored by pass 1's chunk-0 program
    state_ptr,  # [n, passes, 2] int64: (low, high) of each pass, stored by its chunk-0 program
    partial_ptr,  # [n, passes, num_chunks, K] float32: each pass's masses at its keys, by chunk
    logits_stride,
    vocab,
    chunk_blocks,  # BLOCKs a chunk (the last may hold fewer)
    num_chunks,
    pass_index,  # 0 .. passes - 1: a search pass; passes: the last launch, grid (n, 1)
    passes,
    K: tl.constexpr,  # keys weighed a pass (a power of two, at least 2)
    BLOCK: tl.constexpr,
    CHUNKS: tl.constexpr,  # a power of two >= any row's chunk count: from the vocabulary
):
    """One pass of the nucleus search of each flagged entry's row, over one chunk of the row.

    A K-ary search over the float32 order of [lower, top] for the largest key whose mass (tokens at
    or above it) reaches target = top_p x the mass at lower: a logit, since the mass only changes at
    logit values. Invariant: the answer is in [low, high], and the mass at low reaches target. Each
    pass's programs first narrow (low, high) with the previous pass's masses, summed over its
    chunks, keeping the interval between the last key that reaches target and the next: high - low
    drops to at most (high - low) // K, so from fewer than 2^32 keys `passes` = ceil(32 / log2(K))
    passes (8 at K = 16) leave low == high, which the last launch writes as the cutoff. Then each
    weighs K keys from low up (_thresholds) over its chunk. Pass 0's first key is lower itself, so
    pass 1 finds the row's mass at lower in the first column. A search that ends early (low == high)
    weighs nothing more: the later passes only carry its state on."""
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    if tl.load(needs_ptr + entry) != 0:
        state = state_ptr + entry * passes * 2  # this entry's [passes, 2]
        partial = partial_ptr + entry * passes * num_chunks * K  # its [passes, num_chunks, K]
        top = tl.load(top_ptr + entry)
        if pass_index == 0:
            low = _ordered(tl.load(lower_ptr + entry))
            high = tl.maximum(_ordered(top), low)  # lower above top: the answer is lower
        else:
            low = tl.load(state + (pass_index - 1) * 2)
            high = tl.load(state + (pass_index - 1) * 2 + 1)
            if low < high:  # the previous pass weighed its keys: narrow with their masses
                masses = _row_masses_at_keys(
                    partial + (pass_index - 1) * num_chunks * K, num_chunks, K, CHUNKS
                )
                if pass_index == 1:
                    at_lower = tl.sum(tl.where(tl.arange(0, K) == 0, masses, 0.0), axis=0)
                    target = tl.load(top_p_ptr + entry) * at_lower
                    if chunk == 0:
                        tl.store(target_ptr + entry, target)
                else:
                    target = tl.load(target_ptr + entry)
                low, high = _narrow(_thresholds(low, high, K), masses, target, high, K)
        if pass_index == passes:
            tl.store(cutoff_ptr + entry, _from_ordered(low))
        else:
            if chunk == 0:  # the next pass reads this slot; this pass's programs read the previous one
                tl.store(state + pass_index * 2, low)
                tl.store(state + pass_index * 2 + 1, high)
            if low < high:
                base = logits_ptr + tl.load(rows_ptr + entry).to(tl.int64) * logits_stride
                scale = 1.4426950408889634 / tl.load(temperature_ptr + entry)
                first = chunk * chunk_blocks * BLOCK
                end = tl.minimum(first + chunk_blocks * BLOCK, vocab)
                keys = _from_ordered(_thresholds(low, high, K))
                masses = _masses_at_or_above(base, keys, top, scale, first, end, BLOCK)
                tl.store(partial + (pass_index * num_chunks + chunk) * K + tl.arange(0, K), masses)


@triton.jit(do_not_specialize=["chunk_blocks", "num_chunks"])
def _row_mass_kernel(
    logits_ptr,  # [*, vocab] float32, row stride logits_stride
    rows_ptr,  # [n] int32: the logits row of each entry
    top_ptr,  # [n] float32: the row's largest logit
    temperature_ptr,  # [n] float32 (> 0)
    lower_ptr,  # [n] float32: count only logits >= lower
    partial_ptr,  # [n, num_chunks] float32: each chunk's sum
    logits_stride,
    vocab,
    chunk_blocks,  # BLOCKs a chunk (the last may hold fewer)
    num_chunks,
    BLOCK: tl.constexpr,
):
    entry = tl.program_id(0)
    chunk = tl.program_id(1)
    base = logits_ptr + tl.load(rows_ptr + entry).to(tl.int64) * logits_stride
    scale = 1.4426950408889634 / tl.load(temperature_ptr + entry)
    top = tl.load(top_ptr + entry)
    lower = tl.load(lower_ptr + entry)
    first = chunk * chunk_blocks * BLOCK
    end = tl.minimum(first + chunk_blocks * BLOCK, vocab)
    cols = tl.arange(0, BLOCK)
    total = tl.zeros((BLOCK,), tl.float32)
    for start in range(first, end, BLOCK):
        index = start + cols
        logit = tl.load(base + index, mask=index < end, other=float("-inf"))
        total += tl.where(logit >= lower, tl.exp2((logit - top) * scale), 0.0)
    tl.store(partial_ptr + entry * num_chunks + chunk, tl.sum(total, axis=0))


@triton.jit(do_not_specialize=["chunk_blocks"])
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
    chunk_blocks,  # BLOCKs a chunk (the last may hold fewer)
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
    first = chunk * chunk_blocks * BLOCK
    end = tl.minimum(first + chunk_blocks * BLOCK, vocab)
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


def _chunks(vocab: int, block: int, rows: int, device: torch.device) -> tuple[int, int]:
    """(num_chunks, chunk_blocks): each row split into num_chunks chunks of chunk_blocks whole blocks
    (the last may hold fewer), so that rows x num_chunks programs fill the device; a block at least."""
    blocks = triton.cdiv(vocab, block)
    chunk_blocks = triton.cdiv(blocks, min(max(_programs_wanted(device) // max(rows, 1), 1), blocks))
    return triton.cdiv(blocks, chunk_blocks), chunk_blocks


def _max_chunks(vocab: int, block: int) -> int:
    """A power of two >= the chunk count of any batch size (one chunk a block at most): a constexpr
    bound that depends on the vocabulary only, so that no kernel variant depends on the batch."""
    return triton.next_power_of_2(triton.cdiv(vocab, block))


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
    num_chunks, chunk_blocks = _chunks(vocab, block, rows, logits.device)
    # Allocated even for one chunk (then the kernel writes out itself), so that the kernel's
    # signature, and so its compiled variant, is the same at every batch size.
    best_score = torch.empty(rows, num_chunks, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(rows, num_chunks, dtype=torch.int32, device=logits.device)
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
        chunk_blocks,
        num_chunks,
        HAS_CUTOFF=cutoff is not None,
        BLOCK=block,
        num_warps=num_warps,
    )
    if num_chunks > 1:
        _merge_chunks_kernel[(rows,)](
            best_score, best_index, out, num_chunks, vocab, CHUNKS=_max_chunks(vocab, block)
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
    top: torch.Tensor | None = None,
) -> None:
    """Write into cutoff[i], for each i with needs[i] != 0, the nucleus cutoff of logits[rows[i]]
    (as sampling_reference.top_p_cutoffs_reference, up to the float32 order of summation), by a
    k-ary search over the float32 order of [lower, top]: ceil(32 / log2(BISECT_THRESHOLDS)) = 8
    launches that each weigh BISECT_THRESHOLDS cutoffs over every chunk of every row (the first
    also the row's mass), then one that narrows with the last of them and writes cutoff. A fixed
    number of launches, no host sync: graph-capturable.

    logits: [*, vocab] float32, last dim contiguous. rows, needs: [n] int32; temperature (> 0),
    top_p, lower: [n] float32; cutoff: [n] float32, written in place. top: [n] float32, each row's
    largest logit (the sampler has it), or None to compute it here. All contiguous.
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
        ("top", rows if top is None else top, torch.int32 if top is None else torch.float32),
    ):
        _check(name, tensor, (max(n, 0),), dtype, logits)
        if n > 1 and tensor.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous")
    if n <= 0:
        return
    if top is None:
        top = logits.index_select(0, rows.long()).amax(dim=-1)
    vocab = logits.shape[1]
    block, _ = _block(vocab, BISECT_BLOCK)
    num_chunks, chunk_blocks = _chunks(vocab, block, n, logits.device)
    keys = BISECT_THRESHOLDS
    passes = triton.cdiv(32, keys.bit_length() - 1)
    # Scratch: each pass's search state and masses in slots of their own, so that a pass's programs
    # read the previous pass's slots while its chunk-0 programs write its own (no race, no atomics).
    target = torch.empty(n, dtype=torch.float32, device=logits.device)
    state = torch.empty(n, passes, 2, dtype=torch.int64, device=logits.device)
    partial = torch.empty(n, passes, num_chunks, keys, dtype=torch.float32, device=logits.device)
    for pass_index in range(passes + 1):
        _top_p_pass_kernel[(n, num_chunks if pass_index < passes else 1)](
            logits,
            rows,
            top,
            temperature,
            top_p,
            lower,
            needs,
            cutoff,
            target,
            state,
            partial,
            logits.stride(0),
            vocab,
            chunk_blocks,
            num_chunks,
            pass_index,
            passes,
            K=keys,
            BLOCK=block,
            CHUNKS=_max_chunks(vocab, block),
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
    num_chunks, chunk_blocks = _chunks(vocab, block, n, logits.device)
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
            chunk_blocks,
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
    num_chunks, chunk_blocks = _chunks(vocab, block, n, logits.device)
    _penalties_kernel[(n, num_chunks)](
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
        chunk_blocks,
        OUTPUT_COUNT_MASK=OUTPUT_COUNT_MASK,
        BLOCK=block,
        num_warps=num_warps,
    )

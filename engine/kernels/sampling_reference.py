"""The torch reference of the sampling kernels (engine/kernels/sampling.py): what the CPU engine runs
and what the kernel tests compare against, token for token. Plain torch, no triton import.

Penalties (vLLM's arithmetic) change a row's logits from its count row (engine/penalties.py keeps
them: output counts in the low bits, PROMPT_FLAG on the prompt's tokens).

A draw is a Gumbel-max (the exponential race): token = argmax over the kept tokens of
logit + temperature * g, with g = -log(-log(u)) standard Gumbel noise, which picks token i with
probability softmax(logits / temperature)[i]. The uniforms u come from a counter-based hash of (row
state, vocabulary index), and the row state from (key, position), so a draw depends only on the
request's key, the token's position in its output and the logits: not on the batch, the step or any
generator state (graph-safe). The hash is 32-bit integer arithmetic that the kernel does in uint32;
here it runs in int64 with every product kept below 2^63 (no overflow) and masked to 32 bits.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
# lowbias32 (Chris Wellons' hash prospector): x ^= x >> 16; x *= M1; x ^= x >> 15; x *= M2; x ^= x >> 16.
MIX_MULTIPLIER_1 = 0x7FEB352D
MIX_MULTIPLIER_2 = 0x846CA68B
GOLDEN = 0x9E3779B9  # 2^32 / phi, odd: v -> state + v * GOLDEN is a bijection of the vocabulary
POSITION_SALT = 0x5BD1E995  # keeps position 0 of key 0 away from the hash's fixed point at 0
TWO_POW_MINUS_24 = 2.0**-24

# Set in a count row for each token of the prompt: the low 30 bits count the output (max_model_len
# is far below 2^30).
PROMPT_FLAG = 1 << 30
OUTPUT_COUNT_MASK = PROMPT_FLAG - 1


def mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2^32 for int64 x in [0, 2^32): two 16-bit halves of the constant, so no
    product reaches 2^63 (int64 overflow is undefined in C++, whatever it does in practice)."""
    low, high = constant & 0xFFFF, constant >> 16
    return (x * low + (((x * high) & 0xFFFF) << 16)) & MASK32


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 values in [0, 2^32): a bijection with full avalanche. x >= 0, so torch's
    arithmetic right shift is the logical one."""
    x = x ^ (x >> 16)
    x = mul32(x, MIX_MULTIPLIER_1)
    x = x ^ (x >> 15)
    x = mul32(x, MIX_MULTIPLIER_2)
    return x ^ (x >> 16)


def as_uint32(bits: torch.Tensor) -> torch.Tensor:
    """int32 bit patterns (how keys travel in the step's int32 buffers) as int64 values in [0, 2^32)."""
    return bits.to(torch.int64) & MASK32


def row_states(key_lo: torch.Tensor, key_hi: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """[rows] int32 each (key halves and output positions, as bit patterns) -> [rows] int64 in [0, 2^32)."""
    state = mix32(as_uint32(position) ^ POSITION_SALT)
    state = mix32(state ^ as_uint32(key_hi))
    return mix32(state ^ as_uint32(key_lo))


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """int64 hash values in [0, 2^32) -> float32 odd multiples of 2^-24, in [2^-24, 1 - 2^-24]: never
    0 or 1, so log(u) and log(-log(u)) are finite (23 random bits; 1 - 2^-25 would round to 1.0)."""
    return ((bits >> 9).to(torch.float32) * 2.0 + 1.0) * TWO_POW_MINUS_24


def uniforms(states: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows] states -> [rows, vocab] float32 uniforms, one for each (row, vocabulary index)."""
    index = torch.arange(vocab, dtype=torch.int64, device=states.device)
    return uniform_from_bits(mix32((states[:, None] + mul32(index, GOLDEN)[None, :]) & MASK32))


def gumbel_noise(states: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows] states -> [rows, vocab] float32 standard Gumbel noise -log(-log(u)), in [-2.8, 16.7]."""
    return -torch.log(-torch.log(uniforms(states, vocab)))


def sample_reference(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    cutoff: torch.Tensor | None,
    key_lo: torch.Tensor,
    key_hi: torch.Tensor,
    position: torch.Tensor,
) -> torch.Tensor:
    """One token per row: argmax of logit + temperature * gumbel over the tokens with logit >= cutoff.

    logits [rows, vocab] float32; temperature [rows] float32 (0: the plain argmax, bit-identical to
    logits.argmax, since 0 * g adds nothing); cutoff [rows] float32 or None (keep all); key_lo, key_hi,
    position [rows] int32. Returns [rows] int64. Ties go to the lowest index, as torch.argmax.
    """
    noise = gumbel_noise(row_states(key_lo, key_hi, position), logits.shape[1])
    scores = logits + temperature[:, None] * noise
    if cutoff is not None:
        scores = scores.masked_fill(logits < cutoff[:, None], float("-inf"))
    return scores.argmax(dim=-1)


def row_masses_reference(
    logits: torch.Tensor, top: torch.Tensor, temperature: torch.Tensor, lower: torch.Tensor
) -> torch.Tensor:
    """[rows]: sum of exp((logit - top) / temperature) over each row's logits >= lower (softmax's
    denominator over what min-p keeps). logits [rows, vocab] float32; top, temperature, lower [rows]."""
    weights = (logits - top[:, None]).div_(temperature[:, None]).exp_()
    return weights.masked_fill_(logits < lower[:, None], 0.0).sum(dim=-1)


def top_p_cutoffs_reference(
    logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, lower: torch.Tensor
) -> torch.Tensor:
    """The nucleus cutoff of each row by a full sort: the logit of the least likely kept token.

    Among the tokens with logit >= lower (min-p's cutoff, -inf when off), renormalized, the nucleus
    is the smallest set of most likely tokens whose probability reaches top_p; a token is kept when
    the mass ranked strictly above it is < top_p. logits [rows, vocab] float32; temperature (> 0),
    top_p, lower [rows] float32. Returns [rows] float32: keep the tokens with logit >= cutoff.
    """
    values = logits.sort(dim=-1, descending=True).values
    top = values[:, :1]
    weights = torch.exp((values - top) / temperature[:, None])
    weights = weights.masked_fill(values < lower[:, None], 0.0)
    before = weights.cumsum(dim=-1) - weights
    kept = before < top_p[:, None] * weights.sum(dim=-1, keepdim=True)
    kept &= values >= lower[:, None]
    kept[:, 0] = True
    count = kept.sum(dim=-1, keepdim=True)
    return values.gather(1, count - 1)[:, 0]


def apply_penalties(
    logits: torch.Tensor,
    counts: torch.Tensor,
    presence: torch.Tensor,
    frequency: torch.Tensor,
    repetition: torch.Tensor,
) -> torch.Tensor:
    """Penalized copy of logits, vLLM's order and arithmetic. logits [rows, vocab] float32; counts
    [rows, vocab] int32 (PROMPT_FLAG | output count); presence, frequency, repetition [rows] float32.

    A token seen in the prompt or the output has a positive logit divided by the repetition penalty,
    a negative one multiplied by it; then logit -= frequency * output count + presence * (count > 0).
    """
    output = counts & OUTPUT_COUNT_MASK
    repetition = repetition[:, None]
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(counts != 0, penalized, logits)
    return logits - frequency[:, None] * output - presence[:, None] * (output > 0)

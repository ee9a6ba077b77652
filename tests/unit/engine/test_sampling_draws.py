"""The draws themselves, on CPU (the torch reference the CPU engine runs): the counter-based hash, the
Gumbel-max's distribution (chi-square against softmax(logits / temperature), 20,000 draws a case over
rows that share the logits and differ in key and position), the filters' kept sets against a plain
float64 definition for every method, and the Sampler's staging (per-row settings, positions, keys).

Every key set is fixed, so each chi-square is one deterministic computation: it cannot flake.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from scipy.stats import chi2_contingency, chisquare

from engine import SamplingParams
from engine.kernels.sampling_reference import (
    MIX_MULTIPLIER_1,
    MIX_MULTIPLIER_2,
    mix32,
    mul32,
    sample_reference,
    uniform_from_bits,
)
from engine.sampler import (
    WARM_UP_PARAMS,
    FilterMethod,
    Sampler,
    SamplerConfig,
    filter_cutoffs,
    request_key,
)
from engine.sequence import Sequence

DRAWS = 20_000
MIN_P_VALUE = 1e-3  # a chi-square p-value below this fails
LOGITS = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3, 1.2, -0.2, 0.8])
METHODS = [  # sort_rows=0: each method as itself, even for the one row these tests filter
    FilterMethod("sort"),
    FilterMethod("prefix", prefix=3, sort_rows=0),
    FilterMethod("prefix", sort_rows=0),
    FilterMethod("bisect", sort_rows=0),
]


def _lowbias32(x: int) -> int:
    """The hash in plain Python integers."""
    x ^= x >> 16
    x = (x * MIX_MULTIPLIER_1) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * MIX_MULTIPLIER_2) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_the_hash_is_exact_32_bit_arithmetic_in_int64():
    rng = random.Random(0)
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1] + [rng.randrange(2**32) for _ in range(1000)]
    tensor = torch.tensor(values, dtype=torch.int64)
    for constant in (MIX_MULTIPLIER_1, MIX_MULTIPLIER_2, 0xFFFFFFFF, 3):
        assert mul32(tensor, constant).tolist() == [(v * constant) & 0xFFFFFFFF for v in values]
    assert mix32(tensor).tolist() == [_lowbias32(v) for v in values]


def test_uniforms_are_strictly_inside_zero_one():
    bits = torch.tensor([0, 1, 511, 512, 2**31, 2**32 - 512, 2**32 - 1], dtype=torch.int64)
    u = uniform_from_bits(bits)
    assert u.dtype == torch.float32
    assert u.min().item() == 2.0**-24 and u.max().item() == 1.0 - 2.0**-24
    assert torch.isfinite(torch.log(-torch.log(u))).all()


def _draws(
    logits: torch.Tensor, temperature: float, cutoff: float | None = None, key_hi: int = 12345
) -> torch.Tensor:
    """DRAWS tokens from one row of logits: 200 keys x 100 output positions."""
    rows = logits.expand(DRAWS, -1).contiguous()
    index = torch.arange(DRAWS, dtype=torch.int32)
    tokens = sample_reference(
        rows,
        torch.full((DRAWS,), temperature),
        None if cutoff is None else torch.full((DRAWS,), cutoff),
        index // 100,
        torch.full((DRAWS,), key_hi, dtype=torch.int32),
        index % 100,
    )
    return torch.bincount(tokens, minlength=logits.shape[0])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_draws_follow_softmax_of_logits_over_temperature(temperature):
    observed = _draws(LOGITS, temperature)
    expected = torch.softmax(LOGITS.double() / temperature, dim=0) * DRAWS
    assert chisquare(observed.double().numpy(), expected.numpy()).pvalue > MIN_P_VALUE


def test_draws_follow_softmax_over_a_larger_vocabulary():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(1))
    observed = _draws(logits, 1.0, key_hi=-7)
    expected = torch.softmax(logits.double(), dim=0) * DRAWS
    assert expected.min() > 5  # chi-square's usual condition
    assert chisquare(observed.double().numpy(), expected.numpy()).pvalue > MIN_P_VALUE


def test_neighbouring_positions_and_keys_draw_independently():
    """Tokens at output positions 0 and 1 of one key, and at position 0 of keys k and k + 1: their
    joint counts are what independent draws give (a contingency chi-square over 20,000 pairs)."""
    logits = torch.tensor([0.0, 0.4, -0.3, 0.2])
    n = DRAWS
    rows = logits.expand(n, -1).contiguous()
    keys = torch.arange(n, dtype=torch.int32)
    ones = torch.ones(n)
    zeros = torch.zeros(n, dtype=torch.int32)
    first = sample_reference(rows, ones, None, keys, zeros, zeros)
    second = sample_reference(rows, ones, None, keys, zeros, zeros + 1)
    next_key = sample_reference(rows, ones, None, keys + 1, zeros, zeros)
    for other in (second, next_key):
        table = torch.zeros(4, 4)
        table.index_put_((first, other), torch.ones(n), accumulate=True)
        assert chi2_contingency(table.numpy()).pvalue > MIN_P_VALUE


def _reference_kept(
    logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float
) -> set[int]:
    """vLLM's order in float64: min-p, then top-k, then top-p over what is left, renormalized."""
    scaled = [value / temperature for value in logits]
    top = max(scaled)
    weights = [math.exp(value - top) for value in scaled]
    candidates = [i for i, w in enumerate(weights) if w >= min_p]  # p_i / p_max >= min_p
    candidates.sort(key=lambda i: -logits[i])
    if top_k > 0:
        candidates = candidates[:top_k]
    total = sum(weights[i] for i in candidates)
    kept, before = [], 0.0
    for i in candidates:
        if kept and before >= top_p * total:
            break
        kept.append(i)
        before += weights[i]
    return set(kept)


def _cutoff(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float, method):
    vocab = logits.shape[-1]
    return filter_cutoffs(
        logits[None, :],
        torch.zeros(1, dtype=torch.int32),
        torch.tensor([temperature]),
        torch.tensor([top_k if top_k > 0 else vocab], dtype=torch.int32),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
        k_max=top_k,
        top_p_alone=top_p < 1.0 and top_k == 0,
        method=method,
    )[0]


FILTER_CASES = [  # (temperature, top_k, top_p, min_p)
    (1.0, 4, 1.0, 0.0),
    (1.0, 0, 0.7, 0.0),
    (0.7, 0, 0.9, 0.0),
    (1.0, 0, 1.0, 0.2),
    (1.3, 6, 0.8, 0.0),
    (1.0, 0, 0.85, 0.1),
    (0.8, 5, 0.6, 0.05),
]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.top_p}-{m.prefix}")
@pytest.mark.parametrize(("temperature", "top_k", "top_p", "min_p"), FILTER_CASES)
def test_filtered_draws_keep_the_defined_set_and_its_renormalized_distribution(
    method, temperature, top_k, top_p, min_p
):
    kept = _reference_kept(LOGITS.tolist(), temperature, top_k, top_p, min_p)
    cutoff = _cutoff(LOGITS, temperature, top_k, top_p, min_p, method).item()
    assert {i for i, value in enumerate(LOGITS.tolist()) if value >= cutoff} == kept
    observed = _draws(LOGITS, temperature, cutoff)
    assert all(observed[i] == 0 for i in range(len(LOGITS)) if i not in kept)
    index = sorted(kept)
    expected = torch.softmax(LOGITS[index].double() / temperature, dim=0) * DRAWS
    assert chisquare(observed[index].double().numpy(), expected.numpy()).pvalue > MIN_P_VALUE


def _margin(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> float:
    """How far the case is from a float32 rounding flipping the reference's decision."""
    scaled = [value / temperature for value in logits]
    top = max(scaled)
    weights = sorted((math.exp(value - top) for value in scaled), reverse=True)
    margins = [abs(w - min_p) for w in weights] if min_p > 0 else [1.0]
    kept_weights = [w for w in weights if w >= min_p][: top_k if top_k > 0 else None]
    total = sum(kept_weights)
    before = 0.0
    for w in kept_weights:
        margins.append(abs(before / total - top_p))
        before += w
    return min(margins)


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.top_p}-{m.prefix}")
def test_random_filters_match_the_definition(method):
    rng = random.Random(5)
    checked = 0
    for case in range(60):
        vocab = rng.choice([1, 2, 7, 50, 300])
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(case)) * rng.choice(
            [0.5, 2.0, 6.0]
        )
        temperature = rng.choice([0.3, 1.0, 2.5])
        top_k = rng.choice([0, 0, 1, 3, 40, 1000])
        top_p = rng.choice([1.0, 0.95, 0.5, 0.1])
        min_p = rng.choice([0.0, 0.0, 0.05, 0.5])
        if top_k == 0 and top_p == 1.0 and min_p == 0.0:
            continue
        if _margin(logits.tolist(), temperature, top_k, top_p, min_p) < 1e-4:
            continue  # within float32 rounding of an edge: either decision is right
        kept = _reference_kept(logits.tolist(), temperature, min(top_k, vocab), top_p, min_p)
        cutoff = _cutoff(logits, temperature, min(top_k, vocab) if top_k < vocab else 0, top_p, min_p, method)
        assert {i for i, value in enumerate(logits.tolist()) if value >= cutoff} == kept, case
        checked += 1
    assert checked > 30


# -- the Sampler: staging, keys, positions --------------------------------------------------------
VOCAB = 40


def _sampler(max_rows: int = 8, seed: int = 0) -> Sampler:
    return Sampler(SamplerConfig(VOCAB, max_rows, torch.device("cpu"), seed))


def _seq(seq_id: int, params: SamplingParams, outputs: int = 0) -> Sequence:
    seq = Sequence(seq_id, f"r{seq_id}", [1, 2, 3], params)
    seq.output_token_ids = [5] * outputs
    return seq


def _sample(sampler: Sampler, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    return sampler.sample(logits.clone(), sampler.prepare(seqs)).tolist()


def test_a_seeded_row_draws_the_same_token_whatever_shares_its_batch():
    logits = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(2))
    seeded = SamplingParams(temperature=1.0, seed=99)
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.9, top_p=0.8),
        SamplingParams(temperature=1.2, top_k=5, min_p=0.1, seed=3),
        SamplingParams(temperature=1.0, presence_penalty=1.0, repetition_penalty=1.5),
        SamplingParams(temperature=0.5),
    ]
    for position in range(20):
        alone = _sample(_sampler(), [_seq(0, seeded, position)], logits[:1])
        sampler = _sampler()
        batch = [_seq(i + 1, p, position + i) for i, p in enumerate(others)]
        batch.insert(2, _seq(0, seeded, position))
        mixed = _sample(sampler, batch, torch.cat([logits[1:3], logits[:1], logits[3:]]))
        assert mixed[2] == alone[0]
        # The same seed in another sequence (another seq_id) draws the same, too.
        assert _sample(_sampler(seed=7), [_seq(42, seeded, position)], logits[:1]) == alone


def test_the_draw_is_keyed_by_seed_and_output_position():
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(3))
    for seed, outputs in ((5, 0), (5, 7), (2**64 - 1, 3), (-(2**63), 1)):
        token = _sample(_sampler(), [_seq(9, SamplingParams(temperature=0.8, seed=seed), outputs)], logits)
        key = request_key(seed, 0, 9)
        signed = [k - 2**32 if k >= 2**31 else k for k in (key & 0xFFFFFFFF, key >> 32)]
        expected = sample_reference(
            logits,
            torch.tensor([0.8]),
            None,
            torch.tensor([signed[0]], dtype=torch.int32),
            torch.tensor([signed[1]], dtype=torch.int32),
            torch.tensor([outputs], dtype=torch.int32),
        )
        assert token == expected.tolist()


def test_unseeded_keys_come_from_the_engine_seed_and_sequence_id():
    assert request_key(None, 0, 1) == request_key(None, 0, 1)
    assert len({request_key(None, seed, seq_id) for seed in range(3) for seq_id in range(50)}) == 150
    assert request_key(7, 0, 1) == request_key(7, 5, 2) == 7
    assert request_key(-1, 0, 0) == 2**64 - 1


def test_greedy_rows_are_the_argmax_and_greedy_steps_skip_everything_else():
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(4))
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # a tie: the lower index, as torch.argmax
    greedy = [_seq(i, SamplingParams(temperature=0.0)) for i in range(5)]
    sampler = _sampler()
    batch = sampler.prepare(greedy)
    assert not batch.any_random and batch.num_filter_rows == 0 and batch.num_penalty_rows == 0
    assert sampler.sample(logits.clone(), batch).tolist() == logits.argmax(-1).tolist()
    mixed = [*greedy[:2], _seq(10, SamplingParams(temperature=1.0, top_p=0.5)), *greedy[3:]]
    tokens = _sample(_sampler(), mixed, logits)
    assert tokens[:2] + tokens[3:] == logits.argmax(-1)[[0, 1, 3, 4]].tolist()
    assert tokens[3] == 7


def test_the_table_grows_and_released_rows_are_reused():
    sampler = _sampler(max_rows=8)
    logits = torch.randn(8, VOCAB)
    for start in range(0, 200, 8):
        seqs = [_seq(i, SamplingParams(temperature=1.0, seed=i)) for i in range(start, start + 8)]
        assert len(_sample(sampler, seqs, logits)) == 8
    assert len(sampler._table) >= 200
    for i in range(200):
        sampler.release(i)
    assert not sampler._slots


def test_the_warm_up_draws_every_path_and_leaves_nothing_behind():
    sampler = _sampler(max_rows=8)
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(5))
    seqs = [_seq(i, params) for i, params in enumerate(WARM_UP_PARAMS)]
    before = _sample(sampler, seqs, logits[: len(seqs)])
    for i in range(len(seqs)):
        sampler.release(i)
    sampler.warm_up(logits.clone())
    assert not sampler._slots and len(sampler.penalties) == 0
    # The same sequences draw the same tokens afterwards: no state of the warm-up's rows lingers.
    assert _sample(sampler, seqs, logits[: len(seqs)]) == before
    assert _sample(_sampler(max_rows=8), seqs, logits[: len(seqs)]) == before

"""Sampling through the offline API: seeds (alone, batched, chunked; CUDA graphs on and off under
`gpu`), top-k, top-p and min-p (the kept sets of each FilterMethod), stop strings and stop token ids."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import FilterMethod, filter_cutoffs

PROMPT = [1234, 5678, 9012, 3456]


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=512)


def _tokens(llm, **params) -> list[int]:
    return llm.generate([PROMPT], SamplingParams(max_tokens=24, ignore_eos=True, **params))[0].token_ids


def test_same_seed_same_tokens_and_different_seeds_differ(llm):
    a = _tokens(llm, temperature=1.5, seed=7)
    b = _tokens(llm, temperature=1.5, seed=7)
    c = _tokens(llm, temperature=1.5, seed=8)
    assert a == b
    assert a != c


def test_seeded_request_is_reproducible_whatever_shares_its_batch(llm):
    alone = _tokens(llm, temperature=1.0, seed=3)
    batch = llm.generate(
        [[100 + i for i in range(30)], PROMPT, [2000, 2001]],
        [
            SamplingParams(max_tokens=10, temperature=1.0),
            SamplingParams(max_tokens=24, temperature=1.0, seed=3, ignore_eos=True),
            SamplingParams(max_tokens=5),
        ],
    )
    assert batch[1].token_ids == alone


def test_top_k_one_equals_greedy(llm):
    assert _tokens(llm, temperature=1.0, top_k=1, seed=11) == _tokens(llm, temperature=0.0)


METHODS = [  # sort_rows=0: each method as itself, even for the one row these tests filter
    FilterMethod("sort"),
    FilterMethod("prefix", prefix=2, sort_rows=0),
    FilterMethod("prefix", sort_rows=0),
    FilterMethod("bisect", sort_rows=0),
]


def _kept(logits: torch.Tensor, method: FilterMethod, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """Which tokens of a one-row logits tensor the filters keep."""
    vocab = logits.shape[1]
    cutoff = filter_cutoffs(
        logits,
        torch.zeros(1, dtype=torch.int32),
        torch.ones(1),
        torch.tensor([top_k if top_k > 0 else vocab], dtype=torch.int32),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
        k_max=top_k,
        top_p_alone=top_p < 1.0 and top_k == 0,
        method=method,
    )
    return (logits[0] >= cutoff[0]).tolist()


@pytest.mark.parametrize("method", METHODS, ids=lambda m: f"{m.top_p}-{m.prefix}")
def test_top_p_keeps_only_the_nucleus(method):
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.15, 0.07, 0.03]]))
    # Smallest set reaching 0.8: {0.5, 0.25, 0.15}, since 0.5 + 0.25 = 0.75 < 0.8.
    assert _kept(logits, method, top_p=0.8) == [True, True, True, False, False]
    assert _kept(logits, method, top_p=0.7) == [True, True, False, False, False]
    # The most likely token survives even a tiny top_p; top-k applies first.
    assert _kept(logits, method, top_p=0.01) == [True, False, False, False, False]
    assert _kept(logits, method, top_k=2) == [True, True, False, False, False]
    # top-p renormalizes over what top-k kept: 0.5 / 0.9 > 0.5, so {0.5} alone reaches 0.5.
    assert _kept(logits, method, top_k=3, top_p=0.5) == [True, False, False, False, False]
    # min-p keeps p >= min_p * p_max: 0.25 / 0.5 >= 0.4 stays, 0.15 / 0.5 = 0.3 < 0.4 goes.
    assert _kept(logits, method, min_p=0.4) == [True, True, False, False, False]
    # top-p over what min-p kept: {0.5, 0.25, 0.15} renormalized, 0.5 / 0.9 < 0.6 <= 0.75 / 0.9.
    assert _kept(logits, method, min_p=0.2, top_p=0.6) == [True, True, False, False, False]


def test_top_p_sampling_only_draws_from_the_nucleus(llm):
    greedy = _tokens(llm, temperature=0.0)
    for seed in range(5):
        assert _tokens(llm, temperature=1.0, top_p=1e-6, seed=seed) == greedy


def test_stop_string_cuts_text_exactly(llm):
    full = llm.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 12
    stop = full.text[7:11]
    first = full.text.find(stop)
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=[stop])
    )[0]
    assert out.text == full.text[:first]
    assert out.finish_reason == "stop"
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_ids_end_the_request(llm):
    full = _tokens(llm, temperature=0.0)
    stop_token = full[5]
    out = llm.generate(
        [PROMPT], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_token])
    )[0]
    assert out.token_ids == full[: full.index(stop_token) + 1]
    assert out.finish_reason == "stop"


def test_max_tokens_ends_with_length(llm):
    out = llm.generate([PROMPT], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 5
    assert out.finish_reason == "length"


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 1e-300},  # logits / temperature would overflow to inf, then NaN probabilities
        {"temperature": 1e300},
        {"temperature": 1.0, "top_k": 2**70},  # past int64: clamped to the vocabulary
        {"temperature": 1.0, "top_p": 1e-300},
    ],
)
def test_extreme_but_valid_values_sample_without_failing_the_step(llm, params):
    tokens = _tokens(llm, seed=5, **params)
    assert len(tokens) == 24 and all(0 <= t < 32000 for t in tokens)


def test_tiny_temperature_is_greedy(llm):
    assert _tokens(llm, temperature=1e-300, seed=1) == _tokens(llm, temperature=0.0)


def _mixed_requests() -> tuple[list[list[int]], list[SamplingParams]]:
    """A seeded request of each kind beside unseeded, greedy and penalized ones."""
    prompts = [[100 + i for i in range(30)], PROMPT, [2000, 2001], [5000 + 3 * i for i in range(12)], [77]]
    params = [
        SamplingParams(max_tokens=10, temperature=1.0),
        SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, min_p=0.05, seed=21, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=0.0),
        SamplingParams(
            max_tokens=16, temperature=1.1, top_k=40, presence_penalty=0.5, seed=8, ignore_eos=True
        ),
        SamplingParams(max_tokens=12, temperature=0.7, repetition_penalty=1.2, seed=13, ignore_eos=True),
    ]
    return prompts, params


def test_seeded_requests_repeat_alone_batched_and_chunked(llm, tiny_model_dir):
    prompts, params = _mixed_requests()
    alone = {i: llm.generate([prompts[i]], params[i])[0].token_ids for i in (1, 3, 4)}
    batched = llm.generate(prompts, params)
    chunked = LLM(
        str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=16
    ).generate(prompts, params)
    for i, tokens in alone.items():
        assert batched[i].token_ids == tokens
        assert chunked[i].token_ids == tokens


@pytest.mark.gpu
def test_cuda_graphs_on_and_off_draw_the_same_seeded_tokens(tiny_model_dir):
    """float32, so graph replay and eager steps compute the same logits; the draws are keyed by seed
    and output position, never by generator state, so they must agree token for token."""
    import gc

    prompts, params = _mixed_requests()
    results = {}
    for eager in (False, True):
        llm = LLM(
            str(tiny_model_dir), device="cuda", dtype="float32", max_model_len=1024, enforce_eager=eager
        )
        assert (llm.engine.runner.graphs is None) == eager
        outputs = llm.generate(prompts, params)
        results[eager] = [outputs[i].token_ids for i in (1, 3, 4)]
        alone = llm.generate([prompts[1]], params[1])[0].token_ids
        assert alone == results[eager][0]
        del llm, outputs
        gc.collect()
        torch.cuda.empty_cache()
    assert results[False] == results[True]


def test_the_start_up_profile_run_warms_up_the_sampler_on_its_largest_logits(tiny_model_dir, monkeypatch):
    """The runner's profile run (on CUDA it sizes the KV cache) hands the sampler its logits, one row
    a sequence the largest step samples, so that the sampling kernels compile at start-up. An engine
    of its own: the profile run unbinds the KV cache."""
    engine = LLM(
        str(tiny_model_dir),
        device="cpu",
        num_kv_blocks=16,
        max_model_len=128,
        max_num_seqs=8,
        max_num_batched_tokens=64,
    ).engine
    seen: list[tuple[int, ...]] = []
    monkeypatch.setattr(engine.runner.sampler, "warm_up", lambda logits: seen.append(tuple(logits.shape)))
    engine.runner.profile_run()
    assert seen == [(8, engine.model_config.vocab_size)]

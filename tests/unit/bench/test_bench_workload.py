"""Workload generation: seeded determinism, rates and counts of the schedule, prompt contents, datasets."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.workload import (
    SEED_MIX_OUTPUT_LENS,
    SEED_MIX_PROMPT_LENS,
    WorkloadSpec,
    arrival_offsets,
    load_dataset,
    make_request,
)

seeds = st.integers(0, 2**32 - 1)
rates = st.floats(0.1, 1000.0)
shapes = st.floats(0.5, 4.0)


@given(seed=seeds, rate=rates, n=st.integers(0, 300), burstiness=shapes)
def test_schedule_is_seeded_counted_and_ordered(seed, rate, n, burstiness):
    offsets = arrival_offsets(rate, n=n, seed=seed, burstiness=burstiness)
    assert offsets == arrival_offsets(rate, n=n, seed=seed, burstiness=burstiness)
    assert len(offsets) == n
    if n:
        assert offsets[0] == 0.0
    assert all(b >= a for a, b in zip(offsets, offsets[1:], strict=False))


@given(seed=seeds, rate=rates)
def test_rates_share_one_shape(seed, rate):
    """With one seed, a schedule at rate r is the unit-rate schedule divided by r."""
    unit = np.array(arrival_offsets(1.0, n=50, seed=seed))
    np.testing.assert_allclose(arrival_offsets(rate, n=50, seed=seed), unit / rate, rtol=1e-9)


@given(rate=rates, n=st.integers(2, 200))
def test_constant_arrivals_are_evenly_spaced(rate, n):
    offsets = arrival_offsets(rate, n=n, arrival="constant")
    np.testing.assert_allclose(np.diff(offsets), 1.0 / rate, rtol=1e-9)


@settings(max_examples=25, deadline=None)
@given(seed=seeds, rate=rates, burstiness=shapes)
def test_poisson_mean_rate(seed, rate, burstiness):
    # 4000 gaps: the mean's relative standard error is 1/sqrt(4000 * shape) <= 2.3 %; 12 % is ~5 sigma
    offsets = arrival_offsets(rate, n=4001, seed=seed, burstiness=burstiness)
    assert offsets[-1] / 4000 == pytest.approx(1.0 / rate, rel=0.12)


@settings(max_examples=25, deadline=None)
@given(seed=seeds, rate=st.floats(1.0, 500.0), duration=st.floats(1.0, 20.0))
def test_duration_bounds_the_arrivals(seed, rate, duration):
    offsets = arrival_offsets(rate, duration_s=duration, seed=seed)
    assert all(t < duration for t in offsets)
    expected = rate * duration
    assert abs(len(offsets) - expected) <= 6 * expected**0.5 + 2
    # a longer duration extends the same sequence
    assert arrival_offsets(rate, duration_s=duration * 2, seed=seed)[: len(offsets)] == offsets


def test_different_seeds_differ():
    assert arrival_offsets(1.0, n=10, seed=0) != arrival_offsets(1.0, n=10, seed=1)


@pytest.mark.parametrize("kwargs", [{"n": 3, "duration_s": 1.0}, {}])
def test_needs_exactly_one_of_n_or_duration(kwargs):
    with pytest.raises(ValueError, match="exactly one"):
        arrival_offsets(1.0, **kwargs)


def test_rate_must_be_positive():
    with pytest.raises(ValueError, match="rate"):
        arrival_offsets(0.0, n=3)


@settings(max_examples=30, deadline=None)
@given(seed=seeds, index=st.integers(0, 10_000))
def test_seed_mix_requests(seed, index):
    spec = WorkloadSpec(seed=seed, token_range=(1000, 1100))
    request = make_request(spec, index)
    assert request == make_request(spec, index)
    assert request.index == index
    assert request.prompt_len in SEED_MIX_PROMPT_LENS and len(request.prompt) == request.prompt_len
    assert request.max_tokens in SEED_MIX_OUTPUT_LENS
    assert all(1000 <= token < 1100 for token in request.prompt)


def test_seed_mix_draws_every_length():
    requests = [make_request(WorkloadSpec(), i) for i in range(200)]
    assert {r.prompt_len for r in requests} == set(SEED_MIX_PROMPT_LENS)
    assert {r.max_tokens for r in requests} == set(SEED_MIX_OUTPUT_LENS)


def test_fixed_requests():
    request = make_request(WorkloadSpec(kind="fixed", input_len=7, output_len=3), 5)
    assert (len(request.prompt), request.prompt_len, request.max_tokens) == (7, 7, 3)


def test_jsonl_and_sharegpt(tmp_path):
    lines = [
        {"prompt": "hello there", "max_tokens": 5},
        {
            "conversations": [
                {"from": "system", "value": "x"},
                {"from": "human", "value": "a b c"},
                {"from": "gpt", "value": "one two three four"},
            ]
        },  # fmt: skip
        {"conversations": [{"from": "human", "value": "no answer"}]},  # skipped: no gpt turn
        {"prompt": "", "max_tokens": 3},  # skipped: empty prompt
    ]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    assert load_dataset(str(path)) == (("hello there", 5), ("a b c", 4))
    spec = WorkloadSpec(kind="jsonl", dataset=str(path))
    assert [make_request(spec, i).prompt for i in range(3)] == ["hello there", "a b c", "hello there"]
    assert make_request(spec, 1).prompt_len == 3

    array = tmp_path / "sharegpt.json"  # ShareGPT exports are one JSON array
    array.write_text(json.dumps(lines))
    assert load_dataset(str(array)) == load_dataset(str(path))


def test_empty_dataset_is_an_error(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text('{"other": 1}\n')
    with pytest.raises(ValueError, match="no usable entries"):
        load_dataset(str(path))


def test_the_workload_says_how_every_request_samples_and_the_body_carries_it():
    from bench.client import request_body
    from bench.workload import SAMPLED

    greedy = request_body("m", make_request(WorkloadSpec(), 3))
    assert greedy["temperature"] == 0 and "top_p" not in greedy
    sampled_spec = WorkloadSpec(**SAMPLED)
    request = make_request(sampled_spec, 3)
    assert (request.temperature, request.top_p) == (1.0, 0.95)
    assert request.prompt == make_request(WorkloadSpec(), 3).prompt  # same prompts, other sampling
    body = request_body("m", request)
    assert (body["temperature"], body["top_p"], body["ignore_eos"]) == (1.0, 0.95, True)
    with pytest.raises(ValueError, match="temperature"):
        WorkloadSpec(temperature=-1.0)
    with pytest.raises(ValueError, match="top_p"):
        WorkloadSpec(top_p=0.0)

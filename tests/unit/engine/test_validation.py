"""Bad input raises a clear exception naming the field, before anything is scheduled."""

from __future__ import annotations

import pytest

from engine import LLM, InvalidRequestError, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=256)


@pytest.mark.parametrize(
    ("prompt", "params", "param", "message"),
    [
        ("", SamplingParams(), "prompt", "empty"),
        ([], SamplingParams(), "prompt", "empty"),
        ([5] * 300, SamplingParams(max_tokens=1), "prompt", "context"),
        ([5] * 200, SamplingParams(max_tokens=100), "max_tokens", "context"),
        ([5, 6], SamplingParams(max_tokens=0), "max_tokens", "max_tokens"),
        ([5, 32000], SamplingParams(), "prompt", "vocabulary"),
        ([5, -1], SamplingParams(), "prompt", "vocabulary"),
        ([5, 6], SamplingParams(temperature=-0.5), "temperature", "temperature"),
        ([5, 6], SamplingParams(top_p=0.0), "top_p", "top_p"),
        ([5, 6], SamplingParams(top_p=1.5), "top_p", "top_p"),
        ([5, 6], SamplingParams(top_k=-2), "top_k", "top_k"),
        ([5, "x"], SamplingParams(), "prompt", "token ids"),
        ([5, 6], SamplingParams(temperature=float("nan")), "temperature", "temperature"),
        ([5, 6], SamplingParams(temperature=float("inf")), "temperature", "temperature"),
        ([5, 6], SamplingParams(seed=2**64), "seed", "seed"),  # torch.Generator cannot take it
        ([5, 6], SamplingParams(seed=-(2**63) - 1), "seed", "seed"),
        ([5, 6], SamplingParams(seed=2**64, temperature=0.0), "seed", "seed"),  # refused even when greedy
    ],
)
def test_bad_input_raises_before_scheduling(llm, prompt, params, param, message):
    good = [1000, 1001, 1002]
    with pytest.raises(InvalidRequestError, match=message) as error:
        llm.generate([good, prompt], [SamplingParams(max_tokens=4), params])
    assert error.value.param == param
    assert not llm.engine.has_unfinished_requests()  # the good prompt was not scheduled either
    assert llm.engine.allocator.num_used_blocks == 0


def test_unknown_option_is_named(tiny_model_dir):
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(tiny_model_dir), max_num_seq=4)


def test_kv_cache_smaller_than_context_is_refused(tiny_model_dir):
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(tiny_model_dir), device="cpu", num_kv_blocks=4, block_size=16, max_model_len=512)


def test_engine_keeps_working_after_bad_input(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate([[5, 40000]])
    out = llm.generate([[1000, 1001]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].token_ids) == 3


@pytest.mark.parametrize("seed", [0, -(2**63), 2**63, 2**64 - 1])
def test_every_seed_torch_takes_is_accepted(llm, seed):
    params = SamplingParams(max_tokens=2, temperature=1.0, seed=seed, ignore_eos=True)
    assert len(llm.generate([[1000, 1001]], params)[0].token_ids) == 2

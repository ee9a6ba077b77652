"""The Triton attention backend through the engine: the same greedy tokens as the torch reference.

On CPU the kernels run through Triton's interpreter (float32, the tiny model); on CUDA in bf16, where
near-ties may flip a token, so there the outputs must agree on most tokens and each must be a
near-argmax (tests/unit/engine/test_gpu.py holds the bf16 checks against transformers).
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

ON_CUDA = torch.cuda.is_available()


def _generate(model_dir, backend: str, prompts, **options):
    llm = LLM(
        str(model_dir),
        device="cuda" if ON_CUDA else "cpu",
        dtype="float32",
        attention_backend=backend,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=64,  # long prompts are chunked: later chunks read their context from the cache
        block_size=8,
        enforce_eager=True,
        **options,
    )
    assert llm.engine.runner.backend.name == backend
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_triton_backend_generates_what_the_torch_backend_does(tiny_model_dir):
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in (1, 7, 8, 9, 30, 100)]
    reference = _generate(tiny_model_dir, "torch", prompts)
    assert _generate(tiny_model_dir, "triton", prompts) == reference


def test_unknown_backend_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        LLM(str(tiny_model_dir), device="cpu", attention_backend="flash")

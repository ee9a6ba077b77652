"""Synthetic checkpoints: presets match the published shapes, tokenizers round-trip, bf16 stays finite."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from engine import ModelConfig
from engine.synthetic import PRESETS, build_tokenizer, special_tokens, weight_shapes

# The architecture fields of the published Hugging Face configs, stored with the tests so the check runs
# in any checkout (no hub at test time).
PUBLISHED_CONFIGS = Path(__file__).with_name("published_configs")


@pytest.mark.parametrize("preset", ["qwen2.5-1.5b", "tinyllama-1.1b"])
def test_published_presets_match_the_published_configs(preset):
    published = json.loads((PUBLISHED_CONFIGS / f"{preset}.json").read_text())
    assert {k: PRESETS[preset].get(k) for k in published} == published


def test_parameter_counts_match_the_published_models():
    def count(preset):
        return sum(torch.Size(shape).numel() for shape in weight_shapes(PRESETS[preset]).values())

    assert round(count("qwen2.5-1.5b") / 1e9, 2) == 1.54
    assert round(count("tinyllama-1.1b") / 1e9, 2) == 1.10


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_model_dir"])
def test_tokenizer_round_trips_through_auto_tokenizer(fixture, request):
    model_dir = request.getfixturevalue(fixture)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    assert len(tokenizer) == config["vocab_size"]
    assert tokenizer.eos_token_id == config["eos_token_id"]
    text = "hello world, héllo 世界!  two spaces\nand a newline"
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text
    rng = random.Random(1)
    word_ids = [rng.randrange(1000, 30000) for _ in range(200)]
    assert tokenizer.encode(tokenizer.decode(word_ids), add_special_tokens=False) == word_ids


def test_tokenizer_has_exactly_the_vocab_size_with_specials_inside():
    config = PRESETS["qwen2.5-1.5b"]
    specials = special_tokens(config)
    tokenizer = build_tokenizer(config["vocab_size"], specials)
    assert tokenizer.get_vocab_size() == 151936
    assert tokenizer.token_to_id("<|endoftext|>") == 151643
    assert max(tokenizer.get_vocab().values()) == 151935


def test_config_loads_in_transformers_and_engine(tiny_llama_model_dir):
    hf = AutoConfig.from_pretrained(tiny_llama_model_dir)
    ours = ModelConfig.from_dir(tiny_llama_model_dir)
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim) == (
        hf.num_hidden_layers,
        hf.num_key_value_heads,
        hf.hidden_size // hf.num_attention_heads,
    )
    assert ours.rope_scaling["rope_type"] == "llama3"
    assert not ours.tie_word_embeddings and not ours.attention_bias


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_model_dir"])
def test_bf16_activations_stay_finite_in_every_layer(fixture, request):
    model = AutoModelForCausalLM.from_pretrained(request.getfixturevalue(fixture), dtype=torch.bfloat16)
    ids = torch.randint(1000, 30000, (1, 512), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    for hidden in out.hidden_states:
        assert torch.isfinite(hidden).all()
        assert hidden.float().abs().max() < 1e3
    assert torch.isfinite(out.logits).all()


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_llama_model_dir"])
def test_tokenizer_loads_without_the_mistral_regex_warning(fixture, request):
    """transformers 4.57.3+ warns of "an incorrect regex pattern" for a local checkpoint whose config
    names no transformers_version; the synthetic config names the one that wrote it."""
    import logging

    import transformers

    folder = request.getfixturevalue(fixture)
    assert (
        json.loads((folder / "config.json").read_text())["transformers_version"] == transformers.__version__
    )
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("transformers")
    logger.addHandler(handler)
    try:
        AutoTokenizer.from_pretrained(folder)
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "incorrect regex" in r.getMessage()]

"""Random-weight checkpoints of real architectures, written in Hugging Face format.

No model hub is reachable where this project is built and tested, and throughput does not depend on
weight values, so the project writes its own checkpoints: config.json (the published fields), sharded
safetensors with their index, and a byte-level BPE tokenizer of exactly the model's vocabulary size
that transformers (and so vLLM) load as they are.

    python -m engine.synthetic --preset tiny --out models/tiny [--seed 0] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import itertools
import json
import string
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

QWEN_SPECIALS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}  # offsets from the first special id
LLAMA_SPECIALS = {"<unk>": 0, "<s>": 1, "</s>": 2}

# ChatML, as Qwen2.5 uses; the llama-layout presets ship no template (the server's plain default applies).
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _qwen2(
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_pos: int,
    eos: int,
    window_layers: int | None = None,
) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "attention_dropout": 0.0,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": max_pos,
        "max_window_layers": window_layers or layers,  # unused: sliding window is off
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_theta": 1000000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab,
    }


def _llama(
    hidden: int,
    inter: int,
    layers: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    max_pos: int,
    rope_theta: float,
    rope_scaling: dict | None,
) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": inter,
        "max_position_embeddings": max_pos,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-05,
        "rope_scaling": rope_scaling,
        "rope_theta": rope_theta,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "vocab_size": vocab,
    }


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 4.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 1088,
}

PRESETS: dict[str, dict[str, Any]] = {
    # The published architectures (see shared model-configs): Qwen/Qwen2.5-1.5B and TinyLlama-1.1B-Chat-v1.0.
    "qwen2.5-1.5b": _qwen2(1536, 8960, 28, 12, 2, 151936, 131072, eos=151643, window_layers=21),
    "tinyllama-1.1b": _llama(2048, 5632, 22, 32, 4, 32000, 2048, 10000.0, None),
    # Small ones for CPU tests: a 4,352-token context so the seed-mix workload (prompts up to 4,096) fits.
    "tiny": _qwen2(256, 704, 4, 8, 2, 32000, 4352, eos=31997),
    "tiny-llama": _llama(256, 704, 4, 8, 2, 32000, 4352, 500000.0, LLAMA3_SCALING),
}


# -- tokenizer -------------------------------------------------------------------------------------
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map from each byte to a printable character: the alphabet of byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, (chr(c) for c in chars), strict=True))


def _word_tokens(count: int) -> list[str]:
    """Space-prefixed lowercase words, shortest first, so every word's prefix is a token before it."""
    space = bytes_to_unicode()[ord(" ")]
    words: list[str] = []
    for length in itertools.count(1):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            if len(words) == count:
                return words
            words.append(space + "".join(letters))
    return words


def special_tokens(config: dict[str, Any]) -> dict[str, int]:
    if config["model_type"] == "qwen2":
        return {name: config["eos_token_id"] + offset for name, offset in QWEN_SPECIALS.items()}
    return dict(LLAMA_SPECIALS)


def build_tokenizer(vocab_size: int, specials: dict[str, int]):
    """Byte-level BPE with exactly vocab_size entries: 256 bytes, specials at their ids, words to fill."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    taken = set(specials.values())
    if max(taken) >= vocab_size:
        raise ValueError(f"special token ids {sorted(taken)} do not fit a vocabulary of {vocab_size}")
    free_ids = (i for i in range(vocab_size) if i not in taken)
    vocab: dict[str, int] = {}
    for char in sorted(bytes_to_unicode().items()):
        vocab[char[1]] = next(free_ids)
    words = _word_tokens(vocab_size - len(vocab) - len(specials))
    merges = []
    for word in words:
        vocab[word] = next(free_ids)
        merges.append((word[:-1], word[-1]))
    vocab.update(specials)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(name, special=True, normalized=False) for name in specials])
    if tokenizer.get_vocab_size() != vocab_size:
        raise AssertionError(f"tokenizer has {tokenizer.get_vocab_size()} entries, expected {vocab_size}")
    return tokenizer


def write_tokenizer(out: Path, config: dict[str, Any]) -> None:
    specials = special_tokens(config)
    build_tokenizer(config["vocab_size"], specials).save(str(out / "tokenizer.json"))
    by_id = {i: name for name, i in specials.items()}
    tokenizer_config: dict[str, Any] = {
        "model_max_length": config["max_position_embeddings"],
        "bos_token": by_id[config["bos_token_id"]],
        "eos_token": by_id[config["eos_token_id"]],
        "pad_token": by_id[config["eos_token_id"]],
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    if config["model_type"] == "qwen2":
        tokenizer_config["chat_template"] = CHATML_TEMPLATE
    else:
        # A generic fast tokenizer: transformers then uses tokenizer.json as it is (no SentencePiece rebuild).
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        tokenizer_config["unk_token"] = "<unk>"
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


def transformers_version() -> str:
    import transformers

    return transformers.__version__


# -- weights ---------------------------------------------------------------------------------------
def weight_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    bias = config["model_type"] == "qwen2" or config.get("attention_bias", False)
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (hidden,)
        shapes[p + "self_attn.q_proj.weight"] = (q, hidden)
        shapes[p + "self_attn.k_proj.weight"] = (kv, hidden)
        shapes[p + "self_attn.v_proj.weight"] = (kv, hidden)
        if bias:
            shapes[p + "self_attn.q_proj.bias"] = (q,)
            shapes[p + "self_attn.k_proj.bias"] = (kv,)
            shapes[p + "self_attn.v_proj.bias"] = (kv,)
        shapes[p + "self_attn.o_proj.weight"] = (hidden, q)
        shapes[p + "post_attention_layernorm.weight"] = (hidden,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.up_proj.weight"] = (inter, hidden)
        shapes[p + "mlp.down_proj.weight"] = (hidden, inter)
    shapes["model.norm.weight"] = (hidden,)
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], hidden)
    return shapes


def random_tensor(
    name: str, shape: tuple[int, ...], std: float, num_layers: int, generator: torch.Generator
) -> torch.Tensor:
    """Random weights whose layers matter: each projection keeps unit scale (std 1/sqrt(fan_in)), and
    the residual branches are scaled by 1/sqrt(2 x layers) so bf16 activations stay finite through
    every layer. Small embeddings keep the logits from simply repeating the input token."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith(("embed_tokens.weight", "lm_head.weight", ".bias")):
        return torch.randn(shape, generator=generator) * std
    std = shape[-1] ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std = std / (2 * num_layers) ** 0.5
    return torch.randn(shape, generator=generator) * std


def write_checkpoint(
    preset: str, out: str | Path, seed: int = 0, dtype: str = "bfloat16", max_shard_bytes: int = 2 << 30
) -> Path:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r} (known: {sorted(PRESETS)})")
    config = dict(PRESETS[preset], torch_dtype=dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch_dtype = getattr(torch, dtype)
    generator = torch.Generator().manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, shape in weight_shapes(config).items():
        tensor = random_tensor(
            name, shape, config["initializer_range"], config["num_hidden_layers"], generator
        ).to(torch_dtype)
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        filename = (
            "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        save_file(shard, str(out / filename), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, filename))
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for s in shards for t in s.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    # As save_pretrained writes it. Without it, transformers 4.57.3-4.57.6 take any local checkpoint for
    # a Mistral one and warn that the tokenizer has "an incorrect regex pattern" (it has not: ours is
    # plain byte-level BPE); 5.x checks the model type, and takes the field as proof either way.
    written = {**config, "transformers_version": transformers_version()}
    (out / "config.json").write_text(json.dumps(written, indent=2) + "\n")
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "do_sample": False,
    }
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    write_tokenizer(out, config)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m engine.synthetic",
        description="Write a random-weight checkpoint in Hugging Face format.",
    )
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--max-shard-mb", type=int, default=2048, help="split the weights into files of at most this size"
    )
    args = parser.parse_args(argv)
    path = write_checkpoint(args.preset, args.out, args.seed, args.dtype, args.max_shard_mb << 20)
    print(f"wrote {args.preset} to {path}")


if __name__ == "__main__":
    main()

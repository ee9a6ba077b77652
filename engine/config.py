"""Configuration: the user's options (EngineArgs) and the frozen configs derived from them.

EngineArgs mirrors vLLM's option names so that `LLM(model, **options)` and the server's flags read the
same as vLLM's. ModelConfig is parsed from a Hugging Face config.json (legacy `rope_theta`/`rope_scaling`
keys or transformers 5's `rope_parameters`). The scheduler and the allocator get plain integers only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture fields the runner needs; Llama and Qwen2 differ only in bias and tying."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    dtype: str
    eos_token_ids: tuple[int, ...]

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in {model_dir}: expected a Hugging Face model folder")
        raw = json.loads(path.read_text())
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        model_type = raw.get("model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})"
            )
        rope = raw.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is None and rope.get("rope_type", "default") != "default":
            rope_scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type == "default":
                rope_scaling = None
            elif rope_type != "llama3":
                raise ValueError(f"rope scaling of type {rope_type!r} is not supported (supported: llama3)")
        num_heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=raw.get("num_key_value_heads") or num_heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // num_heads,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=raw.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias; Llama only when its config says so.
            attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
            dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32"),
            eos_token_ids=eos_ids,
        )

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        """Bytes of K and V that one token occupies across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass
class EngineArgs:
    """Every option a user can set, named as in vLLM. None means "derive it"."""

    model: str
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int | None = None  # None: DEFAULT_MAX_NUM_SEQS, or the token budget if that is smaller
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs: every step runs eagerly
    # Steps with prompt chunks, up to this many tokens, replay CUDA graphs captured per token count
    # (engine.cuda_graphs); larger ones run eagerly. 0: never.
    mixed_graph_max_tokens: int = 4096
    # Their token counts: this many graph sizes from each power of two to the next (engine.cuda_graphs
    # .token_count_ladder). More: less padding a step (a step of 1,100 tokens pads to 1,280 with 4, to
    # 1,152 with 8), more graphs to capture at start. 8 (48 sizes to 4,096, not 28): a closed loop of
    # 128 in flight ran 0.4% and 2.4% faster than with 4 in two rounds on an H100, start-up 1-5 s longer.
    mixed_graph_ladder_steps: int = 8
    attention_backend: str = "auto"  # auto (triton on CUDA, torch elsewhere), torch or triton
    # Share the KV of prompt prefixes earlier requests computed (block_allocator), as vLLM and SGLang
    # do by default.
    enable_prefix_caching: bool = True

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class CacheConfig:
    """The KV cache as the allocator sees it: how many blocks of how many tokens."""

    block_size: int
    num_blocks: int


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits of the scheduler, and whether it looks prompts up in the prefix cache."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_prefix_caching: bool = True

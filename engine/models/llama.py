"""The Llama/Qwen2 decoder for paged inference: one module, since the two differ by config flags only.

Qwen2 adds q/k/v bias and ties the output head to the embedding; Llama 3 adds llama3 rope scaling.
Every op mirrors transformers' order and dtype handling (RMSNorm in float32, residual adds in the
model dtype), which is what lets the tests compare greedy outputs token for token. q/k/v and
gate/up projections are merged into one matmul each; `load_weights` maps the checkpoint's names.
With `kernels` (the CUDA fast path) the norms (fused with the residual add), rotary and the MLP
activation run as Triton kernels with the same roundings, and projections of a few rows (decode steps
of a few sequences) run through the skinny-matmul kernel; otherwise their torch references.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention import current_metadata
from engine.config import ModelConfig
from engine.kernels.reference import (
    fused_add_rms_norm_reference,
    reference_cos_sin,
    rms_norm_reference,
    rotate_reference,
    silu_and_mul_reference,
)
from engine.models import kernels as fast


class CheckpointFilled:
    """A layer without an initializer. The model is built on the meta device and every parameter is
    then filled from the checkpoint (`load_weights` raises on one it misses), so initializing is wasted
    work; and initializing a meta tensor runs torch's Python reference of the initializer, whose first
    call imports torch._dynamo: 1.5 of the 1.7 s a CPU engine took to build the tiny model."""

    def reset_parameters(self) -> None:
        pass


class Embedding(CheckpointFilled, nn.Embedding):
    """nn.Embedding, filled from the checkpoint only."""


class Linear(CheckpointFilled, nn.Linear):
    """nn.Linear that, with kernels, sends a projection of a few rows (a decode step of a few sequences)
    to the skinny-matmul kernel, which streams the weight faster than cuBLAS's small-M kernels there.
    Filled from the checkpoint only."""

    def __init__(self, in_features: int, out_features: int, bias: bool, kernels: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        self.gemv_rows = fast.gemv_rows(out_features, in_features) if kernels else 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] <= self.gemv_rows:
            return fast.gemv(x, self.weight, self.bias)
        return super().forward(x)


class RMSNorm(nn.Module):
    """RMSNorm, optionally fused with the residual add before it.

    `norm(x)` -> (normed, x); `norm(x, residual)` -> (norm(x + residual), x + residual), where x is a
    sublayer's fresh output: the kernel path overwrites it with the normed rows.
    """

    def __init__(self, size: int, eps: float, kernels: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.kernels = kernels

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            if self.kernels:
                return fast.rms_norm(x, self.weight, self.eps), x
            return rms_norm_reference(x, self.weight, self.eps), x
        if self.kernels:
            return fast.fused_add_rms_norm(x, residual, self.weight, self.eps)
        return fused_add_rms_norm_reference(x, residual, self.weight, self.eps)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """[head_dim / 2] float32, with llama3 scaling when the config asks for it."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


@dataclass
class RopeStep:
    """What every layer's rotary needs in one step: positions [num_tokens]; for the torch path also
    cos and sin [num_tokens, 1, head_dim] in the model's dtype."""

    positions: torch.Tensor
    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (halves), cos/sin precomputed in float32 for every position.

    `for_step` runs once per forward pass and `rotate` once per layer: with kernels, one launch rotates
    q and k in place inside the qkv output; otherwise the torch reference, cos/sin rounded once a step.
    """

    cos_sin: torch.Tensor  # [max_positions, head_dim]: cos of each frequency, then sin

    def __init__(self, config: ModelConfig, max_positions: int, kernels: bool = False) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions
        self.kernels = kernels
        self.register_buffer("cos_sin", torch.empty(max_positions, config.head_dim), persistent=False)

    def init_cache(self) -> None:
        inv_freq = rope_inverse_frequencies(self.config).to(self.cos_sin.device)
        positions = torch.arange(self.max_positions, device=inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_positions, head_dim / 2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    def for_step(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        if self.kernels:
            return RopeStep(positions)
        return RopeStep(positions, *reference_cos_sin(self.cos_sin, positions, dtype))

    def rotate(
        self, query: torch.Tensor, key: torch.Tensor, step: RopeStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if step.cos is None or step.sin is None:
            fast.apply_rotary(query, key, self.cos_sin, step.positions)
            return query, key
        return rotate_reference(query, key, step.cos, step.sin)


class Attention(nn.Module):
    def __init__(
        self, config: ModelConfig, layer_index: int, backend, rotary: RotaryEmbedding, kernels: bool = False
    ) -> None:
        super().__init__()
        self.rotary = [rotary]  # the model's, shared: a list keeps it out of this module's children
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.layer_index = layer_index
        self.scale = self.head_dim**-0.5
        self.qkv_proj = Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias, kernels
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, False, kernels)
        self.backend = backend
        # [2, num_blocks, block_size, num_kv_heads, head_dim]; bound by the runner once sized.
        self.kv_cache: torch.Tensor = torch.empty(0)

    def forward(self, x: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        rotary = self.rotary[0]
        if rope.cos is None and self.backend.fuses_rotary:  # kernels: rotated as K/V are stored, one launch
            out = self.backend.forward(
                q,
                k,
                v,
                self.kv_cache,
                current_metadata(),
                self.scale,
                rotary=(rotary.cos_sin, rope.positions),
            )
        else:
            q, k = rotary.rotate(q, k, rope)
            out = self.backend.forward(q, k, v, self.kv_cache, current_metadata(), self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, kernels: bool = False) -> None:
        super().__init__()
        self.kernels = kernels
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, False, kernels)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, False, kernels)
        # Rows up to which down_proj takes the activation fused into the skinny matmul's input.
        self.fused_down_rows = (
            fast.gemv_rows(config.hidden_size, config.intermediate_size, silu_mul_input=True) if kernels else 0
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)  # [num_tokens, 2 * intermediate]: gate, then up
        if x.shape[0] <= self.fused_down_rows:  # the activation applied as the kernel loads its input
            return fast.gemv(gate_up, self.down_proj.weight, silu_mul_input=True)
        if self.kernels:
            return self.down_proj(fast.silu_and_mul(gate_up))
        return self.down_proj(silu_and_mul_reference(gate_up))


class DecoderLayer(nn.Module):
    """(x, residual) -> (the MLP's output, the running residual); each norm adds the residual first.

    Layer 0 gets residual None (the embeddings are the residual), and the model's final norm adds the
    last layer's output: the sums and roundings of transformers' `residual + sublayer(x)`.
    """

    def __init__(
        self, config: ModelConfig, layer_index: int, backend, rotary: RotaryEmbedding, kernels: bool
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.self_attn = Attention(config, layer_index, backend, rotary, kernels)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.mlp = MLP(config, kernels)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, rope: RopeStep
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope), residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """forward(input_ids [num_tokens], positions [num_tokens]) -> hidden [num_tokens, hidden_size].

    kernels: norms, rotary and the MLP activation through the Triton kernels instead of torch.
    """

    def __init__(self, config: ModelConfig, backend, max_positions: int, kernels: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(config, max_positions, kernels)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, backend, self.rotary, kernels) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, kernels)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        rope = self.rotary.for_step(positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, rope)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_sampled, vocab] in float32."""
        return self.lm_head(hidden).float()

    def bind_kv_caches(self, caches: list[torch.Tensor]) -> None:
        attention: list[Attention] = [layer.self_attn for layer in self.layers]  # type: ignore[misc]
        for module, cache in zip(attention, caches, strict=True):
            module.kv_cache = cache

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in, merging q/k/v and gate/up. Raises if any parameter is missing."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        q, kv = self.config.num_heads * self.config.head_dim, self.config.num_kv_heads * self.config.head_dim
        inter = self.config.intermediate_size
        merged = {
            "q_proj": ("qkv_proj", 0, q),
            "k_proj": ("qkv_proj", q, kv),
            "v_proj": ("qkv_proj", q + kv, kv),
            "gate_proj": ("gate_up_proj", 0, inter),
            "up_proj": ("gate_up_proj", inter, inter),
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in merged:
                target, offset, size = merged[parts[-2]]
                full = ".".join([*parts[:-2], target, parts[-1]])
                params[full].data[offset : offset + size].copy_(tensor)
                loaded.add(f"{full}[{offset}]")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} matches no parameter of the model")
            params[name].data.copy_(tensor)
            loaded.add(name)
        expected = set()
        for name in params:
            if name.endswith(("qkv_proj.weight", "qkv_proj.bias")):
                expected |= {f"{name}[0]", f"{name}[{q}]", f"{name}[{q + kv}]"}
            elif name.endswith("gate_up_proj.weight"):
                expected |= {f"{name}[0]", f"{name}[{inter}]"}
            elif not (name == "lm_head.weight" and self.config.tie_word_embeddings):
                expected.add(name)
        missing = expected - loaded
        if missing:
            raise KeyError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:4]}")

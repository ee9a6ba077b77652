"""Reference paged attention in plain torch: correct on any device, used on CPU and as the CUDA fallback.

Decode sequences (one query token each) are batched: their K/V are gathered from the paged cache
through slot indices built once per step in `prepare` (shared by all layers), and attended with plain
matmuls. Prefill chunks run one sequence at a time through SDPA: a chunk that starts the sequence
attends to its own K/V directly, a later chunk gathers its context from the cache first, with a
causal mask offset by the tokens already there. Every other backend must agree with this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.attention.metadata import AttentionMetadata, RotaryInputs, context_slots

# cuDNN's SDPA builds a new plan for every shape (milliseconds of host time per call): keep it out.
_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class TorchAttentionBackend:
    name = "torch"
    supports_cuda_graphs = False  # the decode gather's width depends on the step's longest context
    # The model rotates q and k itself on this path (its torch rotary, rounded as transformers rounds).
    fuses_rotary = False

    def prepare(self, meta: AttentionMetadata) -> None:
        """Gather indices for the step's decodes, built once and read by every layer."""
        if not meta.num_decodes:
            return
        width = meta.max_decode_len
        meta.decode_slots = context_slots(meta.block_tables[: meta.num_decodes], width, meta.block_size)
        positions = torch.arange(width, device=meta.seq_lens.device)
        meta.decode_mask = positions[None, :] < meta.seq_lens[: meta.num_decodes, None]

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store this step's K/V. kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        flat = kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim]
        slots = meta.slot_mapping.long()
        flat[0].index_copy_(0, slots, key)
        flat[1].index_copy_(0, slots, value)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        rotary: RotaryInputs | None = None,
    ) -> torch.Tensor:
        if rotary is not None:
            raise ValueError("the torch attention backend does not fuse rotary (fuses_rotary is False)")
        self.write_kv(key, value, kv_cache, meta)
        out = torch.empty_like(query)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(query[: meta.num_decodes], kv_cache, meta, scale)
        self.prefill(query, key, value, kv_cache, meta, scale, out)
        return out

    def prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Attention of the prefill chunks (sequences num_decodes..), written into out's rows."""
        starts = meta.query_start_loc_cpu
        for i in range(meta.num_decodes, meta.num_seqs):
            rows = slice(starts[i], starts[i + 1])
            out[rows] = self._prefill(query[rows], key[rows], value[rows], kv_cache, meta, i, scale)

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Batched single-token attention as plain matmuls: no per-shape kernel plans, GQA without copies."""
        assert meta.decode_slots is not None and meta.decode_mask is not None
        n, num_heads, head_dim = query.shape
        flat = kv_cache.flatten(1, 2)
        keys = flat[0][meta.decode_slots]  # [n, max_len, kv_heads, dim]
        values = flat[1][meta.decode_slots]
        kv_heads = keys.shape[2]
        q = query.view(n, kv_heads, num_heads // kv_heads, head_dim)  # [n, kv_heads, group, dim]
        scores = torch.einsum("nhgd,nlhd->nhgl", q.float(), keys.float()) * scale
        scores = scores.masked_fill(~meta.decode_mask[:, None, None, :], float("-inf"))
        probs = scores.softmax(dim=-1).to(values.dtype)
        out = torch.einsum("nhgl,nlhd->nhgd", probs, values)
        return out.reshape(n, num_heads, head_dim)

    def _prefill(
        self,
        query: torch.Tensor,  # [q_len, heads, dim]
        key: torch.Tensor,  # [q_len, kv_heads, dim]: this chunk's own K/V
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        i: int,
        scale: float,
    ) -> torch.Tensor:
        q_len, ctx_len = meta.query_len(i), meta.seq_lens_cpu[i]
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        if q_len == ctx_len:  # the chunk is the whole context: its K/V are at hand, no gather
            k, v = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)
        else:
            slots = context_slots(meta.block_tables[i : i + 1], ctx_len, meta.block_size)[0]
            flat = kv_cache.flatten(1, 2)
            k = flat[0][slots].transpose(0, 1).unsqueeze(0)  # [1, kv_heads, ctx_len, dim]
            v = flat[1][slots].transpose(0, 1).unsqueeze(0)
        with sdpa_kernel(_SDPA_BACKENDS):
            if q_len == ctx_len:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # Query token j sits at position ctx_len - q_len + j and sees every key up to it.
                rows = torch.arange(q_len, device=query.device)[:, None] + (ctx_len - q_len)
                mask = torch.arange(ctx_len, device=query.device)[None, :] <= rows
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

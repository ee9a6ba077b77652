"""Reference paged attention in plain torch: correct on any device, used on CPU and as the CUDA fallback.

Decode sequences (one query token each) are batched: their K/V are gathered from the paged cache into a
padded [batch, max_len] layout and masked. Prefill chunks run one sequence at a time with a causal mask
offset by the tokens already in the cache. The Triton backend (later) must agree with this one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.metadata import AttentionMetadata


class TorchAttentionBackend:
    name = "torch"

    def write_kv(
        self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Store this step's K/V. kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]."""
        flat = kv_cache.flatten(1, 2)  # [2, num_slots, num_kv_heads, head_dim]
        flat[0].index_copy_(0, meta.slot_mapping, key)
        flat[1].index_copy_(0, meta.slot_mapping, value)

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        self.write_kv(key, value, kv_cache, meta)
        out = torch.empty_like(query)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(query[: meta.num_decodes], kv_cache, meta, scale)
        starts = meta.query_start_loc.tolist() if meta.num_decodes < meta.num_seqs else []
        for i in range(meta.num_decodes, meta.num_seqs):
            start, end = starts[i], starts[i + 1]
            out[start:end] = self._prefill(query[start:end], kv_cache, meta, i, scale)
        return out

    def _gather(
        self, kv_cache: torch.Tensor, block_tables: torch.Tensor, max_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the given block tables: [batch, max_len, num_kv_heads, head_dim] each."""
        block_size = kv_cache.shape[2]
        num_blocks = -(-max_len // block_size)
        offsets = torch.arange(block_size, device=block_tables.device)
        slots = (block_tables[:, :num_blocks, None] * block_size + offsets).flatten(1)[:, :max_len]
        flat = kv_cache.flatten(1, 2)
        return flat[0][slots], flat[1][slots]

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        n = meta.num_decodes
        max_len = max(meta.seq_lens_cpu[:n])
        keys, values = self._gather(kv_cache, meta.block_tables[:n], max_len)
        positions = torch.arange(max_len, device=query.device)
        mask = positions[None, :] < meta.seq_lens[:n, None]  # [n, max_len]
        out = F.scaled_dot_product_attention(
            query.unsqueeze(2),  # [n, heads, 1, dim]
            keys.transpose(1, 2),  # [n, kv_heads, max_len, dim]
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    def _prefill(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, i: int, scale: float
    ) -> torch.Tensor:
        q_len, ctx_len = meta.query_lens_cpu[i], meta.seq_lens_cpu[i]
        keys, values = self._gather(kv_cache, meta.block_tables[i : i + 1], ctx_len)
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, q_len, dim]
        k = keys.transpose(1, 2)
        v = values.transpose(1, 2)
        if q_len == ctx_len:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Query token j sits at position ctx_len - q_len + j and sees every key up to it.
            rows = torch.arange(q_len, device=query.device)[:, None] + (ctx_len - q_len)
            mask = torch.arange(ctx_len, device=query.device)[None, :] <= rows
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out[0].transpose(0, 1)

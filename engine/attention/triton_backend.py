"""Paged attention through the Triton kernels: the CUDA fast path, graph-safe for every step a graph serves.

This step's K/V go into the cache with one kernel (engine.kernels.kv_cache), or, when the model hands
the rotary embedding over (`rotary=`), with the kernel that also rotates q and k (engine.kernels.rotary:
one launch a layer fewer). Decodes attend in place through the block table with the flash-decoding
kernel (engine.kernels.decode_attention), and all of the step's prompt chunks attend in one launch of
the varlen prefill kernel (engine.kernels.prefill_attention), each over its cached context plus its own
causal part. A step with prompt chunks replayed from a graph launches the same two kernels over
grids fixed at capture, reading its decodes and chunks from the step buffers (`graph_prefills`). On
CPU the same kernels run through Triton's interpreter, which is how the tests check this backend
without a GPU.
"""

from __future__ import annotations

import functools

import torch

from engine.attention.metadata import AttentionMetadata, RotaryInputs
from engine.kernels.decode_attention import choose_num_splits, paged_decode_attention
from engine.kernels.kv_cache import store_kv
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.kernels.rotary import rotary_store_kv


@functools.cache
def _num_sms(device_index: int | None) -> int:
    if not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index or 0).multi_processor_count


class TritonAttentionBackend:
    name = "triton"
    supports_cuda_graphs = True
    fuses_rotary = True

    def prepare(self, meta: AttentionMetadata) -> None:
        """Nothing to build: the kernels read the step buffers directly; the split count is per layer."""

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        rotary: RotaryInputs | None = None,  # (cos_sin, positions): q and k arrive unrotated
    ) -> torch.Tensor:
        """Store this step's K/V and attend. With rotary, q and k are first rotated in place (bit for bit
        as engine.kernels.rotary.apply_rotary would) by the same launch that stores K/V."""
        # The runner's own buffers: the launchers' argument checks (tested) are skipped on the hot path.
        if rotary is None:
            store_kv(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping, check=False)
        else:
            cos_sin, positions = rotary
            rotary_store_kv(
                query,
                key,
                value,
                cos_sin,
                positions,
                kv_cache[0],
                kv_cache[1],
                meta.slot_mapping,
                check=False,
            )
        out = torch.empty_like(query)
        if meta.graph_prefills:
            return self._graphed_mixed_step(query, kv_cache, meta, scale, out)
        decodes = meta.num_decodes
        if decodes:
            # A pure function of the batch size and the longest context: fixed per captured graph, and
            # chosen once a step (every layer has the same shapes).
            num_splits = meta.decode_splits
            if not num_splits:
                num_splits = meta.decode_splits = choose_num_splits(
                    decodes, key.shape[1], meta.max_decode_len, _num_sms(query.device.index)
                )
            paged_decode_attention(
                query[:decodes],
                kv_cache[0],
                kv_cache[1],
                meta.block_tables,
                meta.seq_lens,
                scale,
                num_splits,
                out=out[:decodes],
                check=False,
            )
        if decodes < meta.num_seqs:
            # The prefill sequences' offsets index the whole query: only their rows are computed.
            paged_prefill_attention(
                query,
                kv_cache[0],
                kv_cache[1],
                meta.block_tables[decodes:],
                meta.query_start_loc[decodes:],
                meta.seq_lens[decodes:],
                scale,
                meta.max_prefill_len,
                out=out,
                check=False,
            )
        return out

    def _graphed_mixed_step(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """Decodes and prompt chunks over grids fixed by the graph: every launch reads the step from
        the step buffers (device), none from the host."""
        assert meta.decode_seq_lens is not None and meta.prefill_query_start_loc is not None
        assert meta.prefill_seq_lens is not None and meta.prefill_block_tables is not None
        rows = meta.graph_decodes
        num_splits = meta.decode_splits
        if not num_splits:
            num_splits = meta.decode_splits = choose_num_splits(
                rows, kv_cache.shape[3], meta.max_decode_len, _num_sms(query.device.index)
            )
        paged_decode_attention(
            query[:rows],
            kv_cache[0],
            kv_cache[1],
            meta.block_tables[:rows],
            meta.decode_seq_lens[:rows],
            scale,
            num_splits,
            out=out[:rows],
            check=False,
        )
        # After the decodes: their zero rows past the step's decodes are prompt tokens, written here.
        paged_prefill_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            meta.prefill_block_tables,
            meta.prefill_query_start_loc,
            meta.prefill_seq_lens,
            scale,
            query.shape[0],
            out=out,
            check=False,
        )
        return out

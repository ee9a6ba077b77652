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

import torch

from engine.attention.metadata import AttentionMetadata, RotaryInputs
from engine.kernels.ceilings import num_sms
from engine.kernels.decode_attention import choose_num_splits, paged_decode_attention
from engine.kernels.kv_cache import store_kv
from engine.kernels.planned_decode_attention import plan_decode, planned_decode_attention, planned_num_splits
from engine.kernels.prefill_attention import paged_prefill_attention
from engine.kernels.rotary import rotary_store_kv

# A decode-only step of fewer rows runs the one-split-count kernel: it cuts a lone sequence evenly and
# merges in a launch of its own, where the plan's last-split merge is slower (an H100: one sequence
# 0.73-0.90x); from this many rows the plan balances the contexts instead.
PLANNED_MIN_DECODES = 16


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
            # A step with prompt chunks replayed from a graph: grids fixed at capture, over every row
            # the step may decode and graph_prefills chunks; the step buffers say which are real.
            assert meta.decode_seq_lens is not None and meta.prefill_query_start_loc is not None
            assert meta.prefill_seq_lens is not None and meta.prefill_block_tables is not None
            decodes, decode_lens = meta.graph_decodes, meta.decode_seq_lens
            chunk_tables, chunk_starts, chunk_lens = (
                meta.prefill_block_tables,
                meta.prefill_query_start_loc,
                meta.prefill_seq_lens,
            )
            longest_chunk = query.shape[0]
        else:
            decodes, decode_lens = meta.num_decodes, meta.seq_lens
            # The prefill sequences' offsets index the whole query: only their rows are computed.
            chunk_tables, chunk_starts, chunk_lens = (
                meta.block_tables[decodes:],
                meta.query_start_loc[decodes:],
                meta.seq_lens[decodes:],
            )
            longest_chunk = meta.max_prefill_len if decodes < meta.num_seqs else 0
        if decodes:
            # Many decodes, or a mixed step's: their contexts range from a few tokens to the longest (a
            # closed loop's newest and oldest sequences), so they are cut by their share of the step's
            # tokens, planned on the device by the first layer and read by every layer
            # (engine.kernels.planned_decode_attention). A few decodes alone (one sequence, a handful):
            # one split count for every row, a pure function of the batch size and the longest context
            # (fixed per captured graph), faster than the plan for one sequence. Either split count is
            # chosen once a step: every layer has the same shapes.
            planned = decodes >= PLANNED_MIN_DECODES or longest_chunk > 0
            if not meta.decode_splits:
                meta.decode_splits = (
                    planned_num_splits(meta.max_decode_len)
                    if planned
                    else choose_num_splits(
                        decodes, key.shape[1], meta.max_decode_len, num_sms(query.device.index)
                    )
                )
            args = (
                query[:decodes],
                kv_cache[0],
                kv_cache[1],
                meta.block_tables,
                decode_lens,
                scale,
                meta.decode_splits,
            )
            if planned:
                if meta.decode_plan is None:
                    meta.decode_plan = plan_decode(
                        query[:decodes], decode_lens, meta.decode_splits, key.shape[1]
                    )
                planned_decode_attention(*args, out=out[:decodes], plan=meta.decode_plan, check=False)
            else:
                paged_decode_attention(*args, out=out[:decodes], check=False)
        if longest_chunk:
            # After the decodes: in a graph, their zero rows past the step's decodes are prompt tokens.
            paged_prefill_attention(
                query,
                kv_cache[0],
                kv_cache[1],
                chunk_tables,
                chunk_starts,
                chunk_lens,
                scale,
                longest_chunk,
                out=out,
                check=False,
            )
        return out

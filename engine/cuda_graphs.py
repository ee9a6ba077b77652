"""CUDA graphs of the whole forward pass: capture once at start-up, replay every step they serve.

Two sets, each a graph per size of a ladder, largest first, all in one memory pool, each over the
first `size` rows of the runner's persistent step buffers. Decode-only steps: a graph per batch size
(1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, up to max_num_seqs); a batch of n sequences
replays the smallest graph of size >= n, its rows n..size-1 padded with context length 0 and KV slot
-1, which the attention kernels skip. Steps with prompt chunks: a graph per token count
(`token_count_ladder`), whose attention reads the step's decodes and chunks from
the step buffers over grids fixed at capture (AttentionMetadata.graph_decodes / graph_prefills). The
runner asks `padded_size` and `replay`; it does not know how the graphs were made. `capture=False`
runs the same forward pass, with the same metadata, without a graph (CPU, where there are none): how
the tests check what a replay computes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import torch
from torch import nn

from engine.attention import AttentionMetadata, forward_context
from engine.step_buffers import StepBuffers


def batch_size_ladder(max_batch: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ..., 64, 80, 96, ... up to max_batch (always included), ascending."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    size = 8
    while size < max_batch:
        sizes.append(size)
        size += 8 if size < 64 else 16
    sizes.append(max_batch)
    return sizes


def token_count_ladder(max_tokens: int, smallest: int = 16, steps_per_doubling: int = 4) -> list[int]:
    """16, 32, 48, ..., then `steps_per_doubling` sizes from each power of two to the next (4: a padded
    step does at most a quarter more matmul work than it needs: ..., 128, 160, ..., 256, 320, ...,
    4096; 8: an eighth, twice the graphs); up to max_tokens (always included), ascending."""
    if steps_per_doubling < 1:
        raise ValueError(f"steps_per_doubling must be >= 1, got {steps_per_doubling}")
    sizes = []
    size = smallest
    while size < max_tokens:
        sizes.append(size)
        power = 1 << (size.bit_length() - 1)
        size += max(smallest, power // steps_per_doubling)
    sizes.append(max_tokens)
    return sizes


class CudaGraphRunner:
    def __init__(
        self,
        model: nn.Module,
        buffers: StepBuffers,
        metadata_for: Callable[[int], AttentionMetadata],
        sizes: list[int],
        capture: bool = True,
    ) -> None:
        self.model = model
        self.buffers = buffers
        self.metadata_for = metadata_for
        self.sizes = sizes
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._metadata: dict[int, AttentionMetadata] = {}
        if capture:
            self.capture()
        else:
            self._metadata = {size: metadata_for(size) for size in sizes}

    def _forward(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        with forward_context(meta):
            return self.model(self.buffers.input_ids[:size], self.buffers.positions[:size])

    @torch.inference_mode()
    def capture(self) -> None:
        buffers = self.buffers
        # Capture-time contents: every row a padding row, so warm-up runs read and write no KV.
        buffers.slot_mapping.fill_(-1)
        buffers.seq_lens.zero_()
        buffers.decode_seq_lens.zero_()
        buffers.prefill_query_start_loc.zero_()
        buffers.prefill_seq_lens.zero_()
        buffers.input_ids.zero_()
        buffers.positions.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in (self.sizes[-1], self.sizes[0]):  # compile kernels, create library handles
                self._forward(size, self.metadata_for(size))
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            meta = self.metadata_for(size)
            self._forward(size, meta)  # warm-up at this size (GEMM algorithm choice)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                hidden = self._forward(size, meta)
            self._graphs[size] = (graph, hidden)
        torch.cuda.synchronize()

    def padded_size(self, num_seqs: int) -> int:
        """The captured size that serves a batch of num_seqs; 0 if none does (run eagerly)."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else 0

    def replay(self, size: int) -> torch.Tensor:
        """Run the graph of this size over the current buffers; [size, hidden] valid until the next replay."""
        if self._metadata:  # not captured: the forward pass the graph would replay
            return self._forward(size, self._metadata[size])
        graph, hidden = self._graphs[size]
        graph.replay()
        return hidden

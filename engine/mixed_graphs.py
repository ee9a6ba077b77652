"""CUDA graphs for steps that carry prompt tokens, captured piecewise around the attention.

A decode-only step replays one graph of the whole forward pass (engine.cuda_graphs). A step with a
prompt chunk cannot: its attention launches depend on host values that change every step (how many
rows decode, the longest chunk, the decode kernel's split count). Run eagerly, such a step makes ~350
launches, and on an H200 the host needs 12-15 ms for them while the GPU needs 3-9 ms (a 1.5B model,
32 decodes and a 256- or 1,536-token chunk): under load, where most steps carry a prompt, the server
waits on Python, not on the GPU. So everything between two attentions is captured, once per
token-count size of a ladder:

    segment 0:      embedding, layer 0's input norm and qkv projection
    segment i:      layer i-1's o_proj, post-attention norm and MLP, layer i's input norm and qkv
    segment L:      layer L-1's o_proj, norm and MLP, the final norm

and each layer's attention (rotary and K/V store, decode and prefill kernels) runs eagerly between
them: it reads the qkv buffer one segment filled and writes the attention buffer the next one reads.
The segments touch neither the KV cache nor the metadata, so a segment graph serves every mix of
decodes and chunks of its token count. A step of n tokens runs at the smallest size >= n; rows n..
are padding: token 0 at position 0, KV slot -1 (nothing stored), in no sequence (nothing attends to
them), and every op of a segment works row by row, so no real row reads them.

`capture=False` runs the same segments without graphs (CPU, where there are none): what the tests
use to check the pieces, the buffers and the padding against the plain forward pass.
"""

from __future__ import annotations

import bisect

import torch

from engine.attention import AttentionMetadata, forward_context
from engine.models.llama import DecoderLayer, LlamaForCausalLM
from engine.step_buffers import StepBuffers


def token_count_ladder(max_tokens: int, smallest: int = 16) -> list[int]:
    """16, 32, 48, ..., then steps of a quarter of the last power of two (a padded step does at most a
    quarter more matmul work than it needs): ..., 128, 160, ..., 256, 320, ..., 4096; up to
    max_tokens (always included), ascending."""
    sizes = []
    size = smallest
    while size < max_tokens:
        sizes.append(size)
        power = 1 << (size.bit_length() - 1)
        size += max(smallest, power // 4)
    sizes.append(max_tokens)
    return sizes


class MixedStepGraphs:
    """The piecewise graphs of one model over the runner's step buffers; `run(size, meta)` -> hidden."""

    def __init__(self, model: LlamaForCausalLM, buffers: StepBuffers, max_tokens: int, capture: bool = True):
        self.model = model
        self.layers: list[DecoderLayer] = list(model.layers)  # type: ignore[arg-type]
        self.buffers = buffers
        self.sizes = token_count_ladder(max_tokens)
        self.captured = capture
        attention = self.layers[0].self_attn
        self.num_heads, self.head_dim = attention.num_heads, attention.head_dim
        weight = model.embed_tokens.weight
        rows = self.sizes[-1]
        width = attention.q_size + 2 * attention.kv_size
        # The tensors that cross a segment's edge: fixed addresses, which the graphs read and write.
        self._qkv = torch.zeros(rows, width, dtype=weight.dtype, device=weight.device)
        self._attended = torch.zeros(rows, attention.q_size, dtype=weight.dtype, device=weight.device)
        self._residual = torch.zeros(rows, model.config.hidden_size, dtype=weight.dtype, device=weight.device)
        self._hidden = torch.zeros(rows, model.config.hidden_size, dtype=weight.dtype, device=weight.device)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        if capture:
            self._capture()

    @property
    def num_segments(self) -> int:
        return len(self.layers) + 1

    def padded_size(self, num_tokens: int) -> int:
        """The size that serves a step of num_tokens; 0 if none does (run eagerly)."""
        index = bisect.bisect_left(self.sizes, num_tokens)
        return self.sizes[index] if index < len(self.sizes) else 0

    def _segment(self, size: int, index: int) -> None:
        """What lies between attention index-1 and attention index, over the first `size` rows."""
        model, layers = self.model, self.layers
        residual_rows = self._residual[:size]
        if index == 0:
            x, residual = model.embed_tokens(self.buffers.input_ids[:size]), None
        else:
            x, residual = layers[index - 1].attention_output(self._attended[:size], residual_rows)
        if index == len(layers):
            self._hidden[:size].copy_(model.norm(x, residual)[0])
            return
        qkv, residual = layers[index].attention_input(x, residual)
        self._qkv[:size].copy_(qkv)
        if residual.data_ptr() != residual_rows.data_ptr():  # the kernels add into it in place
            residual_rows.copy_(residual)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Every segment at every size, largest first, all in one memory pool: the segments run one
        after another and keep nothing but what they copy into the edge buffers, so a graph may reuse
        the memory of those captured before it."""
        self.buffers.input_ids.zero_()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in (self.sizes[-1], self.sizes[0]):  # compile kernels, create library handles
                for index in range(self.num_segments):
                    self._segment(size, index)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for size in reversed(self.sizes):
            graphs = []
            for index in range(self.num_segments):
                self._segment(size, index)  # warm-up at this size (GEMM algorithm choice)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._segment(size, index)
                graphs.append(graph)
            self._graphs[size] = graphs
        torch.cuda.synchronize()

    def run(self, size: int, meta: AttentionMetadata) -> torch.Tensor:
        """The forward pass of a step padded to `size` tokens (input ids and positions already in the
        step buffers, `meta` over the real rows; its slot mapping may cover the padding): [size, hidden],
        valid until the next run."""
        model = self.model
        rope = model.rotary.for_step(self.buffers.positions[:size], self._hidden.dtype)
        qkv = self._qkv[:size]
        attended = self._attended[:size].view(size, self.num_heads, self.head_dim)
        graphs = self._graphs.get(size)
        with forward_context(meta):
            for index, layer in enumerate(self.layers):
                if graphs is not None:
                    graphs[index].replay()
                else:
                    self._segment(size, index)
                layer.self_attn.attend(qkv, rope, out=attended)
            if graphs is not None:
                graphs[-1].replay()
            else:
                self._segment(size, len(self.layers))
        return self._hidden[:size]

"""The model runner: the only place where scheduling decisions become tensors.

It loads the model, sizes and owns the paged KV cache, turns a SchedulerOutput into the step's input
tensors plus AttentionMetadata (`prepare`: numpy into one pinned buffer, one host-to-device copy; the
sampler stages its per-row settings the same way), and queues the forward pass and the sampler
(`launch`, whose tokens arrive through PendingTokens). Within a
batch, single-token queries (decodes) go first so the attention backend can batch them; a decode of a
token the step in flight samples reads it on the device. A decode-only batch on CUDA replays a
captured graph (engine.cuda_graphs) when the backend allows it, and so does a step with prompt
chunks (up to `mixed_graph_max_tokens` tokens and StepCapacity.graph_prefills chunks), whose
attention then reads the step from buffers the runner fills for it; larger steps run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata, forward_context, get_backend
from engine.config import EngineArgs, ModelConfig
from engine.cuda_graphs import CudaGraphRunner, batch_size_ladder, token_count_ladder
from engine.loader import iter_weights
from engine.models import MODEL_CLASSES
from engine.sampler import Sampler, SamplerConfig, SamplingBatch
from engine.scheduler import SchedulerOutput
from engine.sequence import PLACEHOLDER
from engine.sequence import Sequence as SequenceState  # collections.abc's Sequence is taken
from engine.step_buffers import BlockTableRows, StepBuffers, StepCapacity

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes; CPU memory has no natural "fraction" to give


@dataclass(frozen=True)
class RunnerConfig:
    """What the runner is sized for and how it runs; derived by the engine from EngineArgs, whose
    defaults (and the reasons for them) these are, so that a runner made directly runs as the engine's."""

    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    attention_backend: str = EngineArgs.attention_backend
    enforce_eager: bool = EngineArgs.enforce_eager
    # Steps with prompt tokens up to this many tokens replay graphs (0: always eager).
    mixed_graph_max_tokens: int = EngineArgs.mixed_graph_max_tokens
    mixed_graph_ladder_steps: int = EngineArgs.mixed_graph_ladder_steps  # sizes a doubling of the tokens
    seed: int = EngineArgs.seed


@dataclass
class Batch:
    num_tokens: int
    metadata: AttentionMetadata
    num_sampled: int
    sample_order: list[int]  # for each sampled row, its rank among the sampling sequences of the step
    sampled: list[SequenceState]  # the sequences of the sampled rows, in row order
    sampling: SamplingBatch
    graph_size: int = 0  # > 0: replay the decode graph captured for this (padded) batch size
    mixed_size: int = 0  # > 0: replay the mixed-step graph captured for this (padded) token count
    num_fed: int = 0  # rows whose input token is the previous step's sampled token, still on the device


class ModelRunner:
    def __init__(self, model_config: ModelConfig, model_dir: str, config: RunnerConfig) -> None:
        self.config = model_config
        self.runner_config = config
        self.device = config.device
        self.dtype = config.dtype
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len
        self.seed = config.seed
        self.backend = get_backend(config.attention_backend, config.device)
        model_class = MODEL_CLASSES[model_config.model_type]
        # The Triton backend brings the fused elementwise kernels with it (one fast path); the torch
        # backend keeps the whole model on its torch reference.
        kernels = self.backend.name == "triton"
        with torch.device("meta"):
            model = model_class(
                model_config, self.backend, max_positions=config.max_model_len, kernels=kernels
            )
        model = model.to(dtype=config.dtype).to_empty(device=config.device)
        if model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared parameters
        model.load_weights(iter_weights(model_dir))
        model.rotary.init_cache()
        self.model = model.eval()
        max_blocks = -(-config.max_model_len // config.block_size)
        # The start-up profile run packs max_num_batched_tokens into sequences of up to max_model_len.
        max_seqs = max(config.max_num_seqs, -(-config.max_num_batched_tokens // config.max_model_len))
        self.buffers = StepBuffers(
            StepCapacity(config.max_num_batched_tokens, max_seqs, max_blocks), config.device
        )
        self.tables = BlockTableRows(max_seqs, max_blocks)
        self.sampler = Sampler(SamplerConfig(model_config.vocab_size, max_seqs, config.device, config.seed))
        self.graphs: CudaGraphRunner | None = None
        self.mixed_graphs: CudaGraphRunner | None = None
        # Where sampled tokens land on the host: pinned, so the copy back does not block the host; two,
        # since a step's copy can land before the host has read the previous step's tokens.
        pin = config.device.type == "cuda"
        self._sampled_host = [torch.zeros(max_seqs, dtype=torch.int64, pin_memory=pin) for _ in range(2)]
        self._launches = 0
        # The last launched step's sampled tokens (device) and each sampling sequence's index in them:
        # the next step's decodes of those sequences read their input token from there.
        self._last_tokens: torch.Tensor | None = None
        self._last_sample_index: dict[int, int] = {}
        self._next_sample_index: dict[int, int] = {}

    # -- KV cache ----------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.config.kv_bytes_per_token(self.dtype.itemsize) * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        self.model.bind_kv_caches(
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.config.num_layers)]
        )

    def measure_num_blocks(self, gpu_memory_utilization: float) -> int:
        """Size the cache as vLLM does: run the largest batch once, read peak memory, give the rest to KV.

        The budget is gpu_memory_utilization x the device's total memory, for weights, activations
        and KV together; memory other processes or the CUDA context hold counts against it too.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        non_torch = (total - free) - torch.cuda.memory_reserved(self.device)
        available = int(total * gpu_memory_utilization) - peak - max(non_torch, 0)
        logger.info(
            "memory: total %.1f GiB, peak %.2f GiB, other %.2f GiB, KV %.2f GiB",
            total / 2**30,
            peak / 2**30,
            non_torch / 2**30,
            available / 2**30,
        )
        if available < self.block_bytes:
            raise RuntimeError(
                f"no memory left for the KV cache at gpu_memory_utilization={gpu_memory_utilization}: weights and activations take {peak / 2**30:.2f} GiB"
            )
        return available // self.block_bytes

    @torch.inference_mode()
    def profile_run(self) -> None:
        """One forward pass over the largest batch: sequences of up to max_model_len tokens, in a scratch cache."""
        config = self.runner_config
        lengths, left = [], config.max_num_batched_tokens
        while left > 0:
            lengths.append(min(left, self.max_model_len))
            left -= lengths[-1]
        counts = [-(-n // self.block_size) for n in lengths]
        self.allocate_kv_cache(sum(counts))
        # Rows of the table array, unused at start-up (no sequence holds one yet), as scratch tables.
        rows = self.tables.array[: len(lengths)]
        first = 0
        for i, count in enumerate(counts):
            rows[i, :count] = np.arange(first, first + count)
            first += count
        num_tokens = sum(lengths)
        ids = np.random.default_rng(0).integers(0, self.config.vocab_size, num_tokens)
        meta = self._fill(np.zeros(len(lengths), np.int64), np.array(lengths), ids, range(len(lengths)))
        rows[:] = 0
        self.backend.prepare(meta)
        with forward_context(meta):
            hidden = self.model(self.buffers.input_ids[:num_tokens], self.buffers.positions[:num_tokens])
        sampled = hidden[: min(config.max_num_seqs, num_tokens)]
        # The largest step's logits, then the sampler's every path over them (compiling its kernels now,
        # not during the first sampled step), within the peak that sizes the KV cache; the softmax
        # stands for a second temporary of the logits' size (the sampler's copy of filtered rows).
        logits = self.model.compute_logits(sampled)
        self.sampler.warm_up(logits)
        logits.softmax(dim=-1)
        self.model.bind_kv_caches([torch.empty(0)] * self.config.num_layers)
        del hidden, sampled, logits

    def capture_graphs(self) -> None:
        """Capture the decode graphs and the mixed steps' graphs (once the KV cache is bound); a no-op
        where graphs do not apply."""
        config = self.runner_config
        if config.enforce_eager or self.device.type != "cuda" or not self.backend.supports_cuda_graphs:
            return
        start = time.perf_counter()
        self.graphs = CudaGraphRunner(
            self.model, self.buffers, self._graph_metadata, batch_size_ladder(config.max_num_seqs)
        )
        logger.info(
            "captured %d decode CUDA graphs (batch 1..%d) in %.1f s",
            len(self.graphs.sizes),
            self.graphs.sizes[-1],
            time.perf_counter() - start,
        )
        max_tokens = min(config.mixed_graph_max_tokens, config.max_num_batched_tokens)
        if max_tokens > 0:
            start = time.perf_counter()
            self.mixed_graphs = CudaGraphRunner(
                self.model,
                self.buffers,
                self._mixed_graph_metadata,
                token_count_ladder(max_tokens, steps_per_doubling=config.mixed_graph_ladder_steps),
            )
            logger.info(
                "captured %d CUDA graphs for steps with prompt chunks (%d..%d tokens, up to %d chunks) in %.1f s",
                len(self.mixed_graphs.sizes),
                self.mixed_graphs.sizes[0],
                self.mixed_graphs.sizes[-1],
                self.buffers.capacity.graph_prefills,
                time.perf_counter() - start,
            )

    def _mixed_graph_metadata(self, num_tokens: int) -> AttentionMetadata:
        """A mixed step of num_tokens (padded) tokens, for capture: the decode graph's metadata for as
        many rows as the step can have decodes, plus graph_prefills chunks for the prefill kernel; the
        step buffers say which rows and chunks are real (`_fill_graph_view`)."""
        buffers = self.buffers
        meta = self._graph_metadata(self._graph_decode_rows(num_tokens))
        meta.slot_mapping = buffers.slot_mapping[:num_tokens]
        meta.max_prefill_len = num_tokens
        meta.graph_decodes = meta.num_decodes
        meta.graph_prefills = buffers.capacity.graph_prefills
        meta.decode_seq_lens = buffers.decode_seq_lens
        meta.prefill_query_start_loc = buffers.prefill_query_start_loc
        meta.prefill_seq_lens = buffers.prefill_seq_lens
        meta.prefill_block_tables = buffers.prefill_block_tables
        return meta

    def _graph_decode_rows(self, num_tokens: int) -> int:
        """How many rows a mixed graph of num_tokens gives the decode kernel: all a step can have."""
        return min(num_tokens, self.runner_config.max_num_seqs)

    def _fill_graph_view(self, n: int, num_decodes: int, num_tokens: int, rows: int) -> None:
        """The step as a mixed graph's attention reads it, in the host buffers: the decodes' context
        lengths (0 up to `rows`), the chunks' offsets, lengths and tables (empty chunks after them)."""
        buffers = self.buffers
        chunks = n - num_decodes
        buffers.host_decode_seq_lens[:num_decodes] = buffers.host_seq_lens[:num_decodes]
        buffers.host_decode_seq_lens[num_decodes:rows] = 0
        buffers.host_prefill_query_start_loc[: chunks + 1] = buffers.host_query_start_loc[num_decodes : n + 1]
        buffers.host_prefill_query_start_loc[chunks + 1 :] = num_tokens
        buffers.host_prefill_seq_lens[:chunks] = buffers.host_seq_lens[num_decodes:n]
        buffers.host_prefill_seq_lens[chunks:] = 0
        buffers.host_prefill_block_tables[:chunks] = buffers.host_block_tables[num_decodes:n]

    def _graph_metadata(self, batch_size: int) -> AttentionMetadata:
        """Decode-only metadata over the first batch_size rows of the step buffers, for capture."""
        buffers = self.buffers
        meta = AttentionMetadata(
            slot_mapping=buffers.slot_mapping[:batch_size],
            block_tables=buffers.block_tables[:batch_size],
            seq_lens=buffers.seq_lens[:batch_size],
            query_start_loc=buffers.query_start_loc[: batch_size + 1],
            seq_lens_cpu=[self.max_model_len] * batch_size,
            query_start_loc_cpu=list(range(batch_size + 1)),
            num_decodes=batch_size,
            block_size=self.block_size,
            max_decode_len=self.max_model_len,  # a graph serves every context length
        )
        self.backend.prepare(meta)
        return meta

    # -- one step ------------------------------------------------------------------------------
    def _fill(
        self, starts: np.ndarray, query_lens: np.ndarray, token_ids, rows: Sequence[int]
    ) -> AttentionMetadata:
        """Write a step into the host buffers and build its metadata (before upload).

        starts[i]: tokens already cached for sequence i; query_lens[i]: tokens computed now;
        token_ids: the step's tokens, flattened; rows[i]: sequence i's row of self.tables.array.
        """
        buffers = self.buffers
        n, num_tokens = len(starts), int(query_lens.sum())
        query_start = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(query_lens, out=query_start[1:])
        # Position of token t of sequence i: starts[i] + (t - query_start[i]).
        seq_of_token = np.repeat(np.arange(n), query_lens)
        positions = np.arange(num_tokens) + np.repeat(starts - query_start[:-1], query_lens)
        buffers.host_input_ids[:num_tokens] = token_ids
        buffers.host_positions[:num_tokens] = positions
        table_rows = buffers.host_block_tables[:n]
        np.take(self.tables.array, rows, axis=0, out=table_rows)
        blocks = table_rows[seq_of_token, positions // self.block_size]
        buffers.host_slot_mapping[:num_tokens] = blocks * self.block_size + positions % self.block_size
        seq_lens = starts + query_lens
        buffers.host_seq_lens[:n] = seq_lens
        buffers.host_query_start_loc[: n + 1] = query_start
        num_decodes = int(np.argmax(query_lens != 1)) if (query_lens != 1).any() else n
        return AttentionMetadata(
            slot_mapping=buffers.slot_mapping[:num_tokens],
            block_tables=buffers.block_tables[:n],
            seq_lens=buffers.seq_lens[:n],
            query_start_loc=buffers.query_start_loc[: n + 1],
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=query_start.tolist(),
            num_decodes=num_decodes,
            block_size=self.block_size,
            max_decode_len=int(seq_lens[:num_decodes].max()) if num_decodes else 0,
            max_prefill_len=int(query_lens[num_decodes:].max()) if num_decodes < n else 0,
        )

    def prepare(self, out: SchedulerOutput, block_tables: dict[int, list[int]]) -> Batch:
        """block_tables: each scheduled sequence's table (by seq_id), already grown for this step."""
        for seq in out.preempted:  # their blocks were freed: the cached rows are stale
            self.tables.drop(seq.seq_id)
            self.sampler.preempted(seq.seq_id)  # and their penalty counts rebuilt when they resume
        buffers = self.buffers
        buffers.flip()
        items = out.scheduled
        in_order = all(item.num_tokens == 1 for item in items[: sum(i.num_tokens == 1 for i in items)])
        if not in_order:  # a one-token prefill chunk after longer ones: decodes must come first
            items = sorted(items, key=lambda item: item.num_tokens != 1)
        n = len(items)
        starts: list[int] = []
        query_lens: list[int] = []
        token_ids: list[int] = []
        rows: list[int] = []
        sample_rows: list[int] = []
        sample_index: dict[int, int] = {}
        feed_rows: list[int] = []
        feed_sources: list[int] = []
        sample_order: list[int] = []
        sampled: list[SequenceState] = []
        sampling_rank = (
            {id(item): rank for rank, item in enumerate(i for i in out.scheduled if i.samples)}
            if not in_order
            else None
        )
        end = 0
        for item in items:  # one pass: this loop is the host cost of a step at hundreds of sequences
            seq, start, num = item.seq, item.start, item.num_tokens
            starts.append(start)
            query_lens.append(num)
            tokens = seq.token_slice(start, start + num)
            if tokens[-1] == PLACEHOLDER:  # a decode of the token the step in flight samples
                feed_rows.append(len(token_ids) + num - 1)
                feed_sources.append(self._last_sample_index[seq.seq_id])
                tokens = [0]
            token_ids += tokens
            rows.append(self.tables.row(seq.seq_id, block_tables[seq.seq_id]))
            end += num
            if item.samples:
                sample_index[seq.seq_id] = len(sample_rows)
                sample_rows.append(end - 1)
                sample_order.append(len(sample_order) if sampling_rank is None else sampling_rank[id(item)])
                sampled.append(seq)
        meta = self._fill(
            np.array(starts, dtype=np.int64), np.array(query_lens, dtype=np.int64), token_ids, rows
        )
        buffers.host_sample_indices[: len(sample_rows)] = sample_rows
        buffers.host_feed_rows[: len(feed_rows)] = feed_rows
        buffers.host_feed_sources[: len(feed_rows)] = feed_sources
        self._next_sample_index = sample_index
        num_tokens = len(token_ids)
        graph_size = mixed_size = 0
        if self.graphs is not None and meta.num_decodes == n:
            graph_size = self.graphs.padded_size(n)
            if graph_size:
                self._pad(n, graph_size)
        if (
            not graph_size
            and self.mixed_graphs is not None
            and n - meta.num_decodes <= buffers.capacity.graph_prefills
        ):
            mixed_size = self.mixed_graphs.padded_size(num_tokens)
            if mixed_size:
                self._pad_tokens(num_tokens, mixed_size)
                self._fill_graph_view(n, meta.num_decodes, num_tokens, self._graph_decode_rows(mixed_size))
        self.buffers.upload(max(n, graph_size))
        return Batch(
            num_tokens=num_tokens,
            metadata=meta,
            num_sampled=len(sample_rows),
            sample_order=sample_order,
            sampled=sampled,
            sampling=self.sampler.prepare(sampled),
            graph_size=graph_size,
            mixed_size=mixed_size,
            num_fed=len(feed_rows),
        )

    def _pad(self, n: int, size: int) -> None:
        """Rows n..size-1 of a padded decode batch (one token a sequence): no context, KV write skipped."""
        self._pad_tokens(n, size)
        self.buffers.host_seq_lens[n:size] = 0

    def _pad_tokens(self, num_tokens: int, size: int) -> None:
        """Token rows num_tokens..size-1 of a padded step: token 0 at position 0, KV write skipped."""
        buffers = self.buffers
        buffers.host_input_ids[num_tokens:size] = 0
        buffers.host_positions[num_tokens:size] = 0
        buffers.host_slot_mapping[num_tokens:size] = -1

    def release(self, seq_id: int) -> None:
        self.sampler.release(seq_id)
        self.tables.drop(seq_id)

    @torch.inference_mode()
    def launch(self, batch: Batch) -> PendingTokens:
        """Queue the forward pass and the sampling; the tokens arrive later (PendingTokens.result)."""
        buffers = self.buffers
        if batch.num_fed:  # decodes of tokens the previous step sampled: copied on the device, in order
            assert self._last_tokens is not None
            rows = buffers.feed_rows[: batch.num_fed].long()
            sources = buffers.feed_sources[: batch.num_fed].long()
            buffers.input_ids.index_copy_(0, rows, self._last_tokens.index_select(0, sources).int())
        if batch.graph_size:
            assert self.graphs is not None
            hidden = self.graphs.replay(batch.graph_size)
        elif batch.mixed_size:
            assert self.mixed_graphs is not None
            hidden = self.mixed_graphs.replay(batch.mixed_size)
        else:
            self.backend.prepare(batch.metadata)
            with forward_context(batch.metadata):
                hidden = self.model(
                    buffers.input_ids[: batch.num_tokens], buffers.positions[: batch.num_tokens]
                )
        self._last_sample_index = self._next_sample_index
        if not batch.num_sampled:
            self._last_tokens = None
            return PendingTokens(None, None, [])
        logits = self.model.compute_logits(hidden[buffers.sample_indices[: batch.num_sampled]])
        tokens = self.sampler.sample(logits, batch.sampling)
        self._last_tokens = tokens
        if self.device.type != "cuda":
            return PendingTokens(tokens, None, batch.sample_order)
        self._launches += 1
        host = self._sampled_host[self._launches % 2][: len(tokens)]
        host.copy_(tokens, non_blocking=True)
        done = tokens_ready_event()
        done.record()
        return PendingTokens(host, done, batch.sample_order)


def tokens_ready_event() -> torch.cuda.Event:
    """The event a step's host copy of its tokens records, waited on by PendingTokens.result.

    Blocking (cudaEventBlockingSync): the waiting thread sleeps until the device gets there. CUDA's
    default event spins a core for the whole wait, and with async scheduling the engine waits there
    for most of every step (at 128 in flight ~6.6 of ~8 ms on an H100), so a busy server's core burned
    a whole core doing nothing, counted against it by `bench host-cost`. Sleeping costs no device
    time: the next step is already queued behind the one waited for, and the wake-up (microseconds)
    is a small part of the host's share of a step.
    """
    return torch.cuda.Event(blocking=True)


class PendingTokens:
    """A step's sampled tokens on their way to the host; `result()` waits for them.

    The engine does the previous step's output work between `launch` and `result`, while the GPU runs.
    """

    def __init__(self, tokens: torch.Tensor | None, done: torch.cuda.Event | None, order: list[int]) -> None:
        self._tokens = tokens
        self._done = done
        self._order = order

    def running(self) -> bool:
        """Whether the device is still computing them (False on CPU, where a launch runs to the end)."""
        return self._done is not None and not self._done.query()

    def result(self) -> list[int]:
        """The tokens in the order the scheduler listed the sampling sequences."""
        if self._tokens is None:
            return []
        if self._done is not None:
            self._done.synchronize()
        tokens = self._tokens.tolist()
        ordered = [0] * len(tokens)
        for rank, token in zip(self._order, tokens, strict=True):
            ordered[rank] = token
        return ordered

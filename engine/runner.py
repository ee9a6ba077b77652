"""The model runner: the only place where scheduling decisions become tensors.

It loads the model, sizes and owns the paged KV cache, turns a SchedulerOutput into flat input tensors
plus AttentionMetadata (`prepare`), and runs the forward pass and the sampler (`execute`). Within a
batch, single-token queries (decodes) go first so the attention backend can batch them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata, forward_context, get_backend
from engine.attention.metadata import context_slots
from engine.config import ModelConfig
from engine.loader import iter_weights
from engine.models import MODEL_CLASSES
from engine.sampler import sample
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledSequence, SchedulerOutput

logger = logging.getLogger(__name__)

CPU_DEFAULT_KV_CACHE_MEMORY = 1 << 30  # bytes; CPU memory has no natural "fraction" to give


@dataclass
class Batch:
    input_ids: torch.Tensor  # [num_tokens]
    positions: torch.Tensor  # [num_tokens]
    metadata: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled]: rows of the hidden state to turn into logits
    sample_order: list[int]  # for each sampled row, its rank among the sampling sequences of the step
    params: list[SamplingParams]
    generators: list[torch.Generator | None]


class ModelRunner:
    def __init__(
        self,
        model_config: ModelConfig,
        model_dir: str,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        block_size: int,
        seed: int,
    ) -> None:
        self.config = model_config
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}
        model_class = MODEL_CLASSES[model_config.model_type]
        with torch.device("meta"):
            model = model_class(model_config, get_backend("auto"), max_positions=max_model_len)
        model = model.to(dtype=dtype).to_empty(device=device)
        if model_config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight  # to_empty unties shared parameters
        model.load_weights(iter_weights(model_dir))
        model.rotary.init_cache()
        self.model = model.eval()

    # -- KV cache ----------------------------------------------------------------------------
    @property
    def block_bytes(self) -> int:
        return self.config.kv_bytes_per_token(self.dtype.itemsize) * self.block_size

    def allocate_kv_cache(self, num_blocks: int) -> None:
        shape = (2, num_blocks, self.block_size, self.config.num_kv_heads, self.config.head_dim)
        self.model.bind_kv_caches(
            [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.config.num_layers)]
        )

    def measure_num_blocks(
        self, gpu_memory_utilization: float, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        """Size the cache as vLLM does: run the largest batch once, read peak memory, give the rest to KV.

        The budget is gpu_memory_utilization x the device's total memory, for weights, activations
        and KV together; memory other processes or the CUDA context hold counts against it too.
        """
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        self.profile_run(max_num_batched_tokens, max_num_seqs)
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
    def profile_run(self, num_tokens: int, num_seqs: int) -> None:
        """One forward pass over the largest batch: sequences of up to max_model_len tokens, in a scratch cache."""
        lengths = []
        left = num_tokens
        while left > 0:
            lengths.append(min(left, self.max_model_len))
            left -= lengths[-1]
        blocks = sum(-(-n // self.block_size) for n in lengths)
        self.allocate_kv_cache(blocks)
        block_tables, start = [], 0
        for n in lengths:
            count = -(-n // self.block_size)
            block_tables.append(list(range(start, start + count)))
            start += count
        meta, positions = self._metadata([0] * len(lengths), lengths, block_tables)
        input_ids = torch.randint(0, self.config.vocab_size, (num_tokens,), device=self.device)
        with forward_context(meta):
            hidden = self.model(input_ids, positions)
        rows = hidden[torch.arange(min(num_seqs, num_tokens), device=self.device)]
        self.model.compute_logits(rows).softmax(dim=-1)
        self.model.bind_kv_caches([torch.empty(0)] * self.config.num_layers)
        del hidden, rows

    # -- one step ------------------------------------------------------------------------------
    def _metadata(
        self, starts: list[int], query_lens: list[int], block_tables: list[list[int]]
    ) -> tuple[AttentionMetadata, torch.Tensor]:
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        for start, n, table in zip(starts, query_lens, block_tables, strict=True):
            span = range(start, start + n)
            positions.extend(span)
            slots.extend(table[p // self.block_size] * self.block_size + p % self.block_size for p in span)
            query_start.append(query_start[-1] + n)
        width = max(len(t) for t in block_tables)
        padded = [t + [0] * (width - len(t)) for t in block_tables]
        seq_lens = [s + n for s, n in zip(starts, query_lens, strict=True)]
        num_decodes = 0
        while num_decodes < len(query_lens) and query_lens[num_decodes] == 1:
            num_decodes += 1

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(self.device, non_blocking=True)

        block_table_tensor = tensor(padded)
        decode_slots = decode_mask = None
        if num_decodes:
            max_len = max(seq_lens[:num_decodes])
            decode_slots = context_slots(block_table_tensor[:num_decodes], max_len, self.block_size)
            decode_mask = (
                torch.arange(max_len, device=self.device)[None, :] < tensor(seq_lens[:num_decodes])[:, None]
            )
        meta = AttentionMetadata(
            slot_mapping=tensor(slots),
            block_tables=block_table_tensor,
            seq_lens_cpu=seq_lens,
            query_start_loc_cpu=query_start,
            query_lens_cpu=list(query_lens),
            num_decodes=num_decodes,
            block_size=self.block_size,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
        )
        return meta, tensor(positions)

    def prepare(self, out: SchedulerOutput, block_tables: dict[int, list[int]]) -> Batch:
        """block_tables: each scheduled sequence's table (by seq_id), already grown for this step."""
        items: list[ScheduledSequence] = sorted(out.scheduled, key=lambda item: item.num_tokens != 1)
        sampling_rank = {id(item): rank for rank, item in enumerate(i for i in out.scheduled if i.samples)}
        input_ids: list[int] = []
        for item in items:
            input_ids.extend(item.seq.token_slice(item.start, item.start + item.num_tokens))
        meta, positions = self._metadata(
            [i.start for i in items],
            [i.num_tokens for i in items],
            [block_tables[i.seq.seq_id] for i in items],
        )
        sample_indices, sample_order, params, generators = [], [], [], []
        end = 0
        for item in items:
            end += item.num_tokens
            if item.samples:
                sample_indices.append(end - 1)
                sample_order.append(sampling_rank[id(item)])
                params.append(item.seq.params)
                generators.append(self._generator(item.seq.seq_id, item.seq.params))
        return Batch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64).to(self.device, non_blocking=True),
            positions=positions,
            metadata=meta,
            sample_indices=torch.tensor(sample_indices, dtype=torch.int64).to(self.device, non_blocking=True),
            sample_order=sample_order,
            params=params,
            generators=generators,
        )

    def _generator(self, seq_id: int, params: SamplingParams) -> torch.Generator | None:
        if params.greedy:
            return None
        generator = self._generators.get(seq_id)
        if generator is None:
            generator = torch.Generator(device=self.device)
            # An unseeded request still draws reproducibly, from the engine's seed and its arrival order.
            generator.manual_seed(
                params.seed if params.seed is not None else hash((self.seed, seq_id)) & (2**63 - 1)
            )
            self._generators[seq_id] = generator
        return generator

    def release(self, seq_id: int) -> None:
        self._generators.pop(seq_id, None)

    @torch.inference_mode()
    def execute(self, batch: Batch) -> list[int]:
        """Forward + sampling; the tokens come back in the order the scheduler listed the sampling sequences."""
        with forward_context(batch.metadata):
            hidden = self.model(batch.input_ids, batch.positions)
        if not batch.params:
            return []
        logits = self.model.compute_logits(hidden[batch.sample_indices])
        tokens = sample(logits, batch.params, batch.generators)
        ordered = [0] * len(tokens)
        for rank, token in zip(batch.sample_order, tokens, strict=True):
            ordered[rank] = token
        return ordered

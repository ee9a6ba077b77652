"""The step-level engine the server drives: add requests, step, abort, read incremental outputs.

One step reads like its description (`step`): the scheduler picks sequences and token counts, the
runner turns them into tensors and samples, the scheduler applies the tokens, and the detokenizers
turn them into text and apply stop strings. Not thread-safe: one thread owns the engine; only
`validate` may be called from elsewhere.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoTokenizer

from engine import kernel_compiles
from engine.block_allocator import BlockAllocator
from engine.config import CacheConfig, EngineArgs, ModelConfig, SchedulerConfig
from engine.errors import InvalidRequestError
from engine.output_processor import OutputProcessor, RequestOutput, ended_by_text
from engine.runner import CPU_DEFAULT_KV_CACHE_MEMORY, ModelRunner, PendingTokens, RunnerConfig
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence
from engine.step_timing import StepTimer
from engine.validation import RequestValidator

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# Sequences in one step when not given (vLLM's default on GPUs of >= 70 GiB). On the H200, 1,000 seed-mix
# requests at once: 14.1k output tok/s at 256, 16.0k at 512, 16.6k at 1,024 (baselines/nvidia-h200/
# qwen2.5-1.5b/engine-options-2026-12-01/). A token budget smaller than this caps it instead, so that
# every running sequence can still decode in one step.
DEFAULT_MAX_NUM_SEQS = 1024


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and tools. KV blocks: used = referenced by a request, cached =
    unreferenced but kept for the prefix cache, free = neither (total - used - cached). The prefix
    cache counts are tokens since start (`Scheduler.prefix_cache_queries` and `_hits`)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_blocks_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Triton kernel variants compiled since the engine was ready (engine.kernel_compiles): 0 unless a
    # step met a variant the start-up did not.
    kernel_compiles: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Hits / queries since start (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0


@dataclass
class _RequestState:
    seq: Sequence
    num_sent_tokens: int = 0  # output tokens already in a RequestOutput


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    return resolved


def resolve_dtype(dtype: str, config_dtype: str, device: torch.device) -> torch.dtype:
    """auto: the checkpoint's dtype on GPU, float32 on CPU (CPU half-precision matmuls are slow and inexact)."""
    if dtype == "auto":
        name = config_dtype if device.type == "cuda" else "float32"
    else:
        name = dtype
    aliases = {
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
        "float": "float32",
        "fp32": "float32",
    }
    name = aliases.get(name, name)
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not supported (float32, bfloat16, float16 or auto)")
    return getattr(torch, name)


class LLMEngine:
    """`detokenize=False` for an engine core whose API processes turn tokens into text: its outputs
    then carry token ids only and stop strings are left to the caller (`OutputProcessor`)."""

    def __init__(self, args: EngineArgs, detokenize: bool = True) -> None:
        self.args = args
        kernel_compiles.install()
        self.model_config = ModelConfig.from_dir(args.model)
        self.device = resolve_device(args.device)
        self.dtype = resolve_dtype(args.dtype, self.model_config.dtype, self.device)
        self.max_model_len = args.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {self.model_config.max_position_embeddings}"
            )
        self.max_num_batched_tokens = args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS
        if args.max_num_seqs is not None and args.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {args.max_num_seqs}")
        self.max_num_seqs = args.max_num_seqs or min(DEFAULT_MAX_NUM_SEQS, self.max_num_batched_tokens)
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}), so every running sequence can decode in one step"
            )
        if args.mixed_graph_max_tokens < 0:
            raise ValueError(
                f"mixed_graph_max_tokens must be >= 0 (0: no mixed-step graphs), got {args.mixed_graph_max_tokens}"
            )
        if args.mixed_graph_ladder_steps < 1:
            raise ValueError(
                f"mixed_graph_ladder_steps must be >= 1 (graph sizes a doubling of the token count), got {args.mixed_graph_ladder_steps}"
            )
        torch.manual_seed(args.seed)
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.validator = RequestValidator(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.runner = ModelRunner(
            self.model_config,
            args.model,
            RunnerConfig(
                device=self.device,
                dtype=self.dtype,
                max_model_len=self.max_model_len,
                block_size=args.block_size,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                attention_backend=args.attention_backend,
                enforce_eager=args.enforce_eager,
                mixed_graph_max_tokens=args.mixed_graph_max_tokens,
                mixed_graph_ladder_steps=args.mixed_graph_ladder_steps,
                seed=args.seed,
            ),
        )
        num_blocks = self._num_kv_blocks()
        if num_blocks * args.block_size < self.max_model_len:
            raise ValueError(
                f"the KV cache holds {num_blocks * args.block_size} tokens, fewer than max_model_len {self.max_model_len}: give it more memory or lower max_model_len"
            )
        self.runner.allocate_kv_cache(num_blocks)
        self.runner.capture_graphs()
        self.cache_config = CacheConfig(block_size=args.block_size, num_blocks=num_blocks)
        self.scheduler_config = SchedulerConfig(
            self.max_num_seqs,
            self.max_num_batched_tokens,
            self.max_model_len,
            enable_prefix_caching=args.enable_prefix_caching,
        )
        self.allocator = BlockAllocator(num_blocks, args.block_size)
        self.scheduler = Scheduler(self.scheduler_config, self.allocator, self.model_config.eos_token_ids)
        self._requests: dict[str, _RequestState] = {}
        self.outputs = OutputProcessor(self.tokenizer, detokenize)
        self._seq_ids = itertools.count()
        # The step on the GPU: its tokens, outputs and scheduler commit come with the next step() call.
        self._in_flight: tuple[SchedulerOutput, PendingTokens] | None = None
        self.timer = StepTimer()  # per-phase wall time of `step`, read by bench offline and engine.profile
        self._compiles_at_ready = self._compiles_seen = kernel_compiles.compiled()
        logger.info(
            "engine ready: %s on %s in %s, %d KV blocks of %d tokens, %s attention, %s, prefix caching %s",
            args.model,
            self.device,
            self.dtype,
            num_blocks,
            args.block_size,
            self.runner.backend.name,
            "CUDA graphs" if self.runner.graphs is not None else "eager",
            "on" if args.enable_prefix_caching else "off",
        )

    def _num_kv_blocks(self) -> int:
        args = self.args
        if args.num_kv_blocks is not None:
            return args.num_kv_blocks
        if args.kv_cache_memory is not None:
            return args.kv_cache_memory // self.runner.block_bytes
        if self.device.type == "cuda":
            return self.runner.measure_num_blocks(args.gpu_memory_utilization)
        return CPU_DEFAULT_KV_CACHE_MEMORY // self.runner.block_bytes

    # -- requests --------------------------------------------------------------------------------
    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request; raises InvalidRequestError naming the field. Thread-safe."""
        return self.validator.validate(prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams,
        arrival_time: float | None = None,
    ) -> None:
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", "request_id")
        token_ids = self.validate(prompt, params)
        seq = Sequence(next(self._seq_ids), request_id, token_ids, params, arrival_time or time.monotonic())
        self.scheduler.add(seq)
        self._requests[request_id] = _RequestState(seq)
        self.outputs.add(request_id, token_ids, params)

    def abort(self, request_id: str) -> bool:
        """End a request now and give its blocks back; False if it is unknown or already done."""
        state = self._requests.pop(request_id, None)
        if state is None:
            return False
        self.scheduler.abort(request_id)
        self.runner.release(state.seq.seq_id)
        self.outputs.discard(request_id)
        return True

    def is_step_running(self) -> bool:
        """Whether the step launched last is still on the device: time the host has before the device
        waits for the next one (the engine core spends some of it on requests about to arrive)."""
        return self._in_flight is not None and self._in_flight[1].running()

    def has_unfinished_requests(self) -> bool:
        """True while anything runs or waits, or a step's tokens and outputs are still to come."""
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Launch one step, then finish the one before it; returns that earlier step's outputs.

        Steps overlap with the GPU (async scheduling): step N+1 is scheduled and prepared while step
        N still runs, its decodes reading the tokens step N samples straight from the device (the
        scheduler holds a PLACEHOLDER for each until `commit`). Then the host waits for step N's
        tokens, commits them (EOS and stop tokens), and does its output work (detokenizing, stop
        strings, RequestOutputs) while the GPU runs step N+1. So each step's outputs come back from
        the next call (the last ones from a call that launches nothing), and a sequence that stops
        on a token or a stop string was already scheduled once more: that extra token is dropped,
        as for an abort. Length limits are known in advance and cost no extra step.
        """
        timer = self.timer
        with timer.phase("schedule"):
            scheduled = self.scheduler.schedule()
        if scheduled.is_empty:
            return self._finish_in_flight()
        timer.num_steps += 1
        with timer.phase("prepare"):
            batch = self.runner.prepare(
                scheduled,
                {s.seq.seq_id: self.allocator.block_table(s.seq.seq_id) for s in scheduled.scheduled},
            )
        with timer.phase("execute"):
            pending = self.runner.launch(batch)
        with timer.phase("update"):
            for seq in self.scheduler.advance(scheduled):
                self.runner.release(seq.seq_id)  # finished by length: its table row is free
        outputs = self._finish_in_flight()
        self._in_flight = (scheduled, pending)
        if kernel_compiles.compiled() != self._compiles_seen:
            self._warn_compiles()
        return outputs

    def _warn_compiles(self) -> None:
        """A step compiled kernel variants the start-up did not meet: every request in flight waited."""
        now = kernel_compiles.compiled()
        logger.warning(
            "%d Triton kernel variant(s) compiled while serving (%s; %d since the engine was ready): every "
            "request in flight waited for them; a variant the start-up did not meet",
            now - self._compiles_seen,
            ", ".join(kernel_compiles.kernels(self._compiles_seen)),
            now - self._compiles_at_ready,
        )
        self._compiles_seen = now

    def _finish_in_flight(self) -> list[RequestOutput]:
        """Wait for the step in flight, commit its tokens, and build its outputs."""
        if self._in_flight is None:
            return []
        scheduled, pending = self._in_flight
        self._in_flight = None
        timer = self.timer
        with timer.phase("execute"):
            token_ids = pending.result()
        with timer.phase("update"):
            for seq in self.scheduler.commit(scheduled, token_ids):
                self.runner.release(seq.seq_id)  # its blocks are free: so is its table row
        with timer.phase("outputs"):
            return self._outputs(scheduled)

    def _outputs(self, scheduled: SchedulerOutput) -> list[RequestOutput]:
        outputs = []
        for item in scheduled.scheduled:
            if not item.samples:
                continue
            state = self._requests.get(item.seq.request_id)
            if state is None:  # aborted during the step
                continue
            seq = state.seq
            # Tokens of a step still in flight (PLACEHOLDERs at the end) are not output yet.
            committed = len(seq.output_token_ids) - seq.num_pending
            new_ids = seq.output_token_ids[state.num_sent_tokens : committed]
            finished = seq.is_finished and not seq.num_pending
            output = self.outputs.process(seq.request_id, new_ids, seq.finish_reason if finished else None)
            if state.num_sent_tokens == 0:
                output.first_scheduled_time = seq.first_scheduled_time
            if ended_by_text(output, seq.finish_reason if finished else None):
                if not seq.is_finished:
                    self.scheduler.finish(seq, "stop")  # drops the token of the step in flight
                finished = True
            outputs.append(output)
            state.num_sent_tokens = committed
            if finished:
                del self._requests[seq.request_id]
                self.runner.release(seq.seq_id)
        return outputs

    # -- introspection ---------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        return EngineStats(
            self.scheduler.num_running,
            self.scheduler.num_waiting,
            self.allocator.num_used_blocks,
            self.allocator.num_blocks,
            self.allocator.num_cached_blocks,
            self.scheduler.prefix_cache_queries,
            self.scheduler.prefix_cache_hits,
            kernel_compiles.compiled() - self._compiles_at_ready,
        )

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block (as vLLM's reset_prefix_cache), e.g. between benchmark
        levels that repeat prompts; returns how many blocks became free. Running requests go on."""
        return self.scheduler.reset_prefix_cache()

    def config_dict(self) -> dict[str, Any]:
        """Every option in force, with derived values filled in."""
        config = self.args.as_dict()
        config.update(
            num_kv_blocks=self.cache_config.num_blocks,
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_num_seqs=self.max_num_seqs,
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            attention_backend=self.runner.backend.name,
            cuda_graphs=self.runner.graphs is not None,
            # the largest step with prompt tokens that replays graphs (0: such steps run eagerly)
            mixed_graph_max_tokens=(
                self.runner.mixed_graphs.sizes[-1] if self.runner.mixed_graphs is not None else 0
            ),
        )
        return config

"""Prometheus metrics of one app, in a registry of its own (never the process-global one).

Two sources. What the engine core counts (its gauges, preemptions, prefix cache lookups, the
requests pending over every API process) is the same in every API process: each renders the latest
`CoreStats` it heard at scrape time (`CoreFigures`). What an API process sees of its own requests
(arrivals, first tokens, finishes, rejections, tokens streamed) is counted where it happens; with
several API processes (`python -m server --api-server-count N`) those counters and histograms live in
prometheus_client's multiprocess files (`multiprocess_dir`, the launcher's PROMETHEUS_MULTIPROC_DIR)
and any process's /metrics sums them, and only the first process records the step times, which every
process hears. The answering process's own figures (process_resident_memory_bytes, ...) come along;
while tracemalloc traces (cli.py starts it under PAGED_ENGINE_TRACEMALLOC=1), so does the Python heap
as it counts it (the soak test reads both).
"""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.core_messages import CoreStats

CONTENT_TYPE = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_STEP_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.5,
)


class CoreFigures(Collector):
    """The engine core's own figures, from the latest `CoreStats` an API process heard: counted once
    however many API processes serve them (the core's counters are totals since its start)."""

    def __init__(self, stats: CoreStats | None = None) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self.stats
        if stats is None:
            return
        engine = stats.engine
        gauges = (
            ("engine_requests_running", "Requests the scheduler is running.", engine.num_running),
            ("engine_requests_waiting", "Requests waiting to be scheduled.", engine.num_waiting),
            (
                "server_requests_pending",
                "Requests admitted and not finished, over every API process (the admission count).",
                stats.num_pending,
            ),
            ("engine_kv_blocks_used", "KV cache blocks referenced by a request.", engine.kv_blocks_used),
            (
                "engine_kv_blocks_cached",
                "KV cache blocks no request references, kept for the prefix cache (evicted when needed).",
                engine.kv_blocks_cached,
            ),
            ("engine_kv_blocks_total", "KV cache blocks in all.", engine.kv_blocks_total),
        )
        for name, documentation, value in gauges:
            yield GaugeMetricFamily(name, documentation, value=value)
        # vLLM's prefix_cache_queries and prefix_cache_hits: tokens of admitted requests looked up, and
        # of those the tokens found cached; hits / queries is the hit rate.
        counters = (
            (
                "engine_prefix_cache_queries",
                "Tokens of admitted requests looked up in the prefix cache.",
                engine.prefix_cache_queries,
            ),
            (
                "engine_prefix_cache_hits",
                "Tokens of admitted requests found in the prefix cache (not computed).",
                engine.prefix_cache_hits,
            ),
            ("engine_preemptions", "Sequences preempted for lack of KV blocks.", stats.num_preemptions),
            (
                "engine_kernel_compiles",
                "Triton kernel variants compiled since the engine was ready: each stalled every request in flight.",
                engine.kernel_compiles,
            ),
        )
        for name, documentation, value in counters:
            yield CounterMetricFamily(name, documentation, value=value)


class ServerMetrics:
    """`multiprocess_dir`: this is one of several API processes, whose counters meet there;
    `records_steps`: this process records the core's step times (one of the several does)."""

    def __init__(self, multiprocess_dir: str | None = None, records_steps: bool = True) -> None:
        self.multiprocess_dir = multiprocess_dir
        self.records_steps = records_steps
        self.core = CoreFigures()
        self.registry = CollectorRegistry()
        registry = self.registry
        self.python_heap = Gauge(
            "server_python_heap_traced_bytes",
            "Python heap in use as tracemalloc counts it (only while tracing: PAGED_ENGINE_TRACEMALLOC=1).",
            registry=registry,
            multiprocess_mode="liveall",
        )
        self.prompt_tokens = Counter(
            "engine_prompt_tokens", "Prompt tokens of accepted requests.", registry=registry
        )
        self.generation_tokens = Counter("engine_generation_tokens", "Tokens generated.", registry=registry)
        self.request_success = Counter(
            "engine_request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=registry,
        )
        self.requests_rejected = Counter(
            "server_requests_rejected", "Requests answered 503 by admission control.", registry=registry
        )

        def latency(name: str, documentation: str) -> Histogram:
            return Histogram(name, documentation, buckets=_LATENCY_BUCKETS, registry=registry)

        self.time_to_first_token = latency(
            "engine_time_to_first_token_seconds", "Arrival to first generated token."
        )
        # engine_time_to_first_token_seconds in four parts, which add up to it request by request:
        # where a slow first token waits (the hops between processes, the queue, the prompt's steps).
        self.request_to_core = latency(
            "server_request_to_core_seconds",
            "The API process handing a request to the engine core, to the core taking it.",
        )
        self.queue_time = latency(
            "engine_request_queue_time_seconds",
            "The engine core taking a request, to the scheduler first giving it a step.",
        )
        self.prefill_time = latency(
            "engine_request_prefill_time_seconds",
            "The scheduler first giving a request a step, to the core sending its first token "
            "(its prompt's steps and the step its token comes back in).",
        )
        self.first_token_delivery = latency(
            "server_first_token_delivery_seconds",
            "The engine core sending a request's first token, to the API process taking it.",
        )
        self.e2e_latency = latency("engine_e2e_request_latency_seconds", "Arrival to finish.")
        self.step_time = Histogram(
            "engine_step_time_seconds",
            "Duration of one engine step.",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        if multiprocess_dir is None:
            self._rendered = registry
        else:  # the files of every API process, summed; the core's figures; this process's own
            self._rendered = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._rendered, path=multiprocess_dir)
        self._rendered.register(self.core)
        ProcessCollector(registry=self._rendered)  # process_resident_memory_bytes, cpu seconds, open fds

    # -- LoopObserver (called on the event loop as the core's outputs arrive) --------------------
    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(self, step_seconds: float, num_new_tokens: int) -> None:
        if self.records_steps:
            self.step_time.observe(step_seconds)
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)

    def on_first_token(
        self, seconds_since_arrival: float, parts: tuple[float, float, float, float] | None
    ) -> None:
        self.time_to_first_token.observe(seconds_since_arrival)
        if parts is not None:
            to_core, queued, prefill, delivery = parts
            self.request_to_core.observe(to_core)
            self.queue_time.observe(queued)
            self.prefill_time.observe(prefill)
            self.first_token_delivery.observe(delivery)

    def on_request_finished(self, finish_reason: str, seconds_since_arrival: float) -> None:
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e_latency.observe(seconds_since_arrival)

    def on_stats(self, stats: CoreStats) -> None:
        self.core.stats = stats

    # -- rendering (event loop) ------------------------------------------------------------------
    def render(self) -> bytes:
        if tracemalloc.is_tracing():
            # A diagnostic mode: collect first, so the figure is the live heap, not cyclic garbage
            # waiting for the collector (which would make it rise and fall with the collector's timing).
            gc.collect()
            self.python_heap.set(tracemalloc.get_traced_memory()[0])
        return generate_latest(self._rendered)

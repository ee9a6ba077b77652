"""Prometheus metrics of one app, in a registry of its own (never the process-global one).

The engine loop thread feeds `ServerMetrics` through the LoopObserver methods (prometheus_client's
metrics are thread-safe); `GET /metrics` renders the registry with `render`. The process's own
figures (process_resident_memory_bytes, ...) come along; while tracemalloc traces (cli.py starts it
under PAGED_ENGINE_TRACEMALLOC=1), so does the Python heap as it counts it (the soak test reads both).
"""

from __future__ import annotations

import gc
import tracemalloc

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)

from engine import EngineStats

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


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        ProcessCollector(registry=registry)  # process_resident_memory_bytes, cpu seconds, open fds
        self.python_heap = Gauge(
            "server_python_heap_traced_bytes",
            "Python heap in use as tracemalloc counts it (only while tracing: PAGED_ENGINE_TRACEMALLOC=1).",
            registry=registry,
        )
        self.requests_running = Gauge(
            "engine_requests_running", "Requests the scheduler is running.", registry=registry
        )
        self.requests_waiting = Gauge(
            "engine_requests_waiting", "Requests waiting to be scheduled.", registry=registry
        )
        self.requests_pending = Gauge(
            "server_requests_pending",
            "Requests accepted and not finished (admission count).",
            registry=registry,
        )
        self.kv_blocks_used = Gauge(
            "engine_kv_blocks_used", "KV cache blocks referenced by a request.", registry=registry
        )
        self.kv_blocks_cached = Gauge(
            "engine_kv_blocks_cached",
            "KV cache blocks no request references, kept for the prefix cache (evicted when needed).",
            registry=registry,
        )
        self.kv_blocks_total = Gauge("engine_kv_blocks_total", "KV cache blocks in all.", registry=registry)
        # vLLM's prefix_cache_queries and prefix_cache_hits: tokens of admitted requests looked up, and
        # of those the tokens found cached; hits / queries is the hit rate.
        self.prefix_cache_queries = Counter(
            "engine_prefix_cache_queries",
            "Tokens of admitted requests looked up in the prefix cache.",
            registry=registry,
        )
        self.prefix_cache_hits = Counter(
            "engine_prefix_cache_hits",
            "Tokens of admitted requests found in the prefix cache (not computed).",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "engine_prompt_tokens", "Prompt tokens of accepted requests.", registry=registry
        )
        self.generation_tokens = Counter("engine_generation_tokens", "Tokens generated.", registry=registry)
        self.preemptions = Counter(
            "engine_preemptions", "Sequences preempted for lack of KV blocks.", registry=registry
        )
        self.request_success = Counter(
            "engine_request_success",
            "Requests finished, by finish reason.",
            ["finished_reason"],
            registry=registry,
        )
        self.requests_rejected = Counter(
            "server_requests_rejected", "Requests answered 503 by admission control.", registry=registry
        )
        self.time_to_first_token = Histogram(
            "engine_time_to_first_token_seconds",
            "Arrival to first generated token.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.e2e_latency = Histogram(
            "engine_e2e_request_latency_seconds",
            "Arrival to finish.",
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        )
        self.step_time = Histogram(
            "engine_step_time_seconds",
            "Duration of one engine step.",
            buckets=_STEP_BUCKETS,
            registry=registry,
        )
        self._num_preemptions = 0
        self._prefix_cache_queries = 0
        self._prefix_cache_hits = 0

    # -- LoopObserver (called from the engine thread) -------------------------------------------
    def on_request_added(self, num_prompt_tokens: int) -> None:
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_step(self, step_seconds: float, num_new_tokens: int) -> None:
        self.step_time.observe(step_seconds)
        if num_new_tokens:
            self.generation_tokens.inc(num_new_tokens)

    def on_first_token(self, seconds_since_arrival: float) -> None:
        self.time_to_first_token.observe(seconds_since_arrival)

    def on_request_finished(self, finish_reason: str, seconds_since_arrival: float) -> None:
        self.request_success.labels(finished_reason=finish_reason).inc()
        self.e2e_latency.observe(seconds_since_arrival)

    def on_stats(self, stats: EngineStats, num_preemptions: int) -> None:
        self.requests_running.set(stats.num_running)
        self.requests_waiting.set(stats.num_waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_cached.set(stats.kv_blocks_cached)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        # The engine counts since its start; the counters advance by what is new.
        if num_preemptions > self._num_preemptions:
            self.preemptions.inc(num_preemptions - self._num_preemptions)
        self._num_preemptions = num_preemptions
        if stats.prefix_cache_queries > self._prefix_cache_queries:
            self.prefix_cache_queries.inc(stats.prefix_cache_queries - self._prefix_cache_queries)
            self.prefix_cache_hits.inc(stats.prefix_cache_hits - self._prefix_cache_hits)
        self._prefix_cache_queries = stats.prefix_cache_queries
        self._prefix_cache_hits = stats.prefix_cache_hits

    # -- rendering (event loop) ------------------------------------------------------------------
    def render(self, num_pending: int) -> bytes:
        self.requests_pending.set(num_pending)
        if tracemalloc.is_tracing():
            # A diagnostic mode: collect first, so the figure is the live heap, not cyclic garbage
            # waiting for the collector (which would make it rise and fall with the collector's timing).
            gc.collect()
            self.python_heap.set(tracemalloc.get_traced_memory()[0])
        return generate_latest(self.registry)

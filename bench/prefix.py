"""The server's prefix cache, seen from the client: its hit counters, its reset, and a closed-loop level
measured from an empty cache with prompts no earlier level sent.

bench.suite (`bench run --fresh-prefix-cache`) and the perf tier's prefix-cache cases call
`run_fresh_level`; every `bench run` level records its hit rate where the server exposes one.
Both servers count in tokens: this project's `engine_prefix_cache_{queries,hits}_total` and vLLM's
`vllm:prefix_cache_{queries,hits}_total` (summed over its label sets); `POST /reset_prefix_cache`
empties the cache (vLLM serves it only with VLLM_SERVER_DEV_MODE=1 in the server's environment).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import httpx

from bench.client import Endpoint
from bench.runner import LevelResult, LoadConfig, run_closed_loop
from bench.server_metrics import TIMEOUT_S, auth_headers, metric_totals, read_settled_totals, read_totals
from bench.workload import WorkloadSpec

# Counter names, as each server's /metrics writes them: this project's first, then vLLM's.
QUERIES = ("engine_prefix_cache_queries_total", "vllm:prefix_cache_queries_total")
HITS = ("engine_prefix_cache_hits_total", "vllm:prefix_cache_hits_total")
NO_RESET_HINT = "vLLM serves /reset_prefix_cache only with VLLM_SERVER_DEV_MODE=1 in its environment"


@dataclass(frozen=True)
class CacheCounters:
    """Prompt tokens looked up in the prefix cache, and of those the tokens found there, since start."""

    queries: float
    hits: float


def cache_counters(totals: dict[str, float] | None) -> CacheCounters | None:
    """The prefix cache's counters from a server's metric totals (bench.server_metrics); None when it
    has neither server's."""
    if totals is None or not any(name in totals for name in (*QUERIES, *HITS)):
        return None
    return CacheCounters(
        sum(totals.get(name, 0.0) for name in QUERIES), sum(totals.get(name, 0.0) for name in HITS)
    )


def parse_counters(text: str) -> CacheCounters | None:
    """The prefix cache's counters from a Prometheus text page (each summed over its label sets);
    None when the page has neither server's."""
    return cache_counters(metric_totals(text))


def read_counters(endpoint: Endpoint) -> CacheCounters | None:
    """`GET /metrics` at the server root, parsed; None when it does not answer or has no such counters."""
    return cache_counters(read_totals(endpoint))


def read_settled_counters(endpoint: Endpoint) -> CacheCounters | None:
    """The counters once two reads agree (bench.server_metrics.read_settled_totals): read right after
    a level's last stream ends, a server that publishes its engine's figures after the step that sent
    the last token (or on a timer) may not have counted the level's last lookups yet."""
    return cache_counters(read_settled_totals(endpoint, (*QUERIES, *HITS)))


def reset_prefix_cache(endpoint: Endpoint) -> str:
    """`POST /reset_prefix_cache` at the server root: "" when it answered 200, else why not."""
    try:
        response = httpx.post(
            f"{endpoint.root_url}/reset_prefix_cache", headers=auth_headers(endpoint), timeout=TIMEOUT_S
        )
    except httpx.HTTPError as exc:
        return f"POST /reset_prefix_cache failed: {exc!r}"
    if response.status_code == 200:
        return ""
    hint = f" ({NO_RESET_HINT})" if response.status_code == 404 else ""
    return f"POST /reset_prefix_cache answered {response.status_code}{hint}"


def hit_figures(before: CacheCounters | None, after: CacheCounters | None) -> dict[str, float]:
    """A level's figures from the counters read around it: prefix_cache_queries and prefix_cache_hits
    (prompt tokens), prefix_cache_hit_rate = hits / queries; {} when the server exposes no counters."""
    if before is None or after is None:
        return {}
    queries, hits = after.queries - before.queries, after.hits - before.hits
    return {
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries > 0 else math.nan,
    }


def level_seed(base: int, level: int) -> int:
    """The seed of a fresh level: the workload's, moved past every earlier level's (and the warm-up's,
    base + 1, which the perf tier sends), so none of its prompts, prefixes or conversations was sent
    before."""
    return base + 1000 * (level + 1)


def run_fresh_level(
    endpoint: Endpoint,
    workload: WorkloadSpec,
    concurrency: int,
    load: LoadConfig,
    level: int,
    clock_zero: float | None = None,
) -> LevelResult:
    """A closed loop from an empty prefix cache, with prompts no earlier level sent: reset the cache,
    move the seed (level_seed), run, and add the level's hit figures (hit_figures) and `seed` to its
    summary; a server that refused the reset gets a warning, and the fresh seed still keeps the
    earlier levels' prompts out of its cache hits.

    Without both, a workload that repeats its requests at every level (seed-mix restarts at index 0)
    would be a full hit from the second level on, and a shared prefix would be cached before its
    level began."""
    refused = reset_prefix_cache(endpoint)
    fresh = dataclasses.replace(workload, seed=level_seed(workload.seed, level))
    before = read_settled_counters(endpoint)
    result = run_closed_loop(endpoint, fresh, concurrency, load, clock_zero)
    result.summary.update(hit_figures(before, read_settled_counters(endpoint)), seed=fresh.seed)
    result.summary["prefix_cache_reset"] = not refused
    if refused:
        result.warnings.append(f"concurrency {concurrency}: the prefix cache was not reset: {refused}")
    return result

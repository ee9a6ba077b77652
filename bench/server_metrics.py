"""A server's own Prometheus figures (`GET /metrics`), read by the client around a level: what the
server saw of the load the client measured.

Both servers' pages are read the same way: each sample's name without its labels, summed over its
label sets (vLLM labels every sample with the model and engine). bench.prefix takes the prefix cache
counters from these totals; `level_figures` the rest of a level's figures (bench's suite and the perf
tier alike): `first_token_figures` the parts of the time to first token, where a server splits it:
this project's four (to the core, queued, prefill, delivery: they add up to its TTFT request by
request), vLLM's queue and prefill times; `kernel_compile_figures` the kernel variants this project's
server compiled during the level (engine.kernel_compiles).
"""

from __future__ import annotations

import math
import time

import httpx

from bench.client import Endpoint

TIMEOUT_S = 30.0

# (level figure, its label on the terminal, this project's histogram, vLLM's histogram or None): the
# mean over the requests whose first token came during the level, in seconds. The server's TTFT counts
# from when its API process handed the request on (after parsing and tokenizing), so it is shorter
# than the client's; the parts after it add up to it.
FIRST_TOKEN_PARTS: tuple[tuple[str, str, str, str | None], ...] = (
    (
        "server_ttft_mean_s",
        "server TTFT mean",
        "engine_time_to_first_token_seconds",
        "vllm:time_to_first_token_seconds",
    ),
    ("server_to_core_mean_s", "to core", "server_request_to_core_seconds", None),
    ("server_queue_mean_s", "queued", "engine_request_queue_time_seconds", "vllm:request_queue_time_seconds"),
    (
        "server_prefill_mean_s",
        "prefill",
        "engine_request_prefill_time_seconds",
        "vllm:request_prefill_time_seconds",
    ),
    ("server_delivery_mean_s", "delivery", "server_first_token_delivery_seconds", None),
)
FIRST_TOKEN_KEYS = tuple(key for key, _, _, _ in FIRST_TOKEN_PARTS)
# Kernel variants the server compiled during a level (this project's server only): each a stall of
# every request in flight, so a level with some ran below what the server does once warm.
KERNEL_COMPILES_KEY = "server_kernel_compiles"
KERNEL_COMPILES_METRIC = "engine_kernel_compiles_total"


def metric_totals(text: str) -> dict[str, float]:
    """Each sample of a Prometheus text page by its name, labels dropped, summed over its label sets."""
    totals: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        try:
            value = float(line.rsplit(" ", 1)[1])
        except (IndexError, ValueError):
            continue
        totals[name] = totals.get(name, 0.0) + value
    return totals


def auth_headers(endpoint: Endpoint) -> dict[str, str]:
    """The endpoint's API key as a bearer token (a server started with --api-key wants it on /metrics)."""
    return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def read_totals(endpoint: Endpoint) -> dict[str, float] | None:
    """`GET /metrics` at the server root as metric_totals; None when it does not answer 200."""
    try:
        response = httpx.get(
            f"{endpoint.root_url}/metrics", headers=auth_headers(endpoint), timeout=TIMEOUT_S
        )
    except httpx.HTTPError:
        return None
    return metric_totals(response.text) if response.status_code == 200 else None


def read_settled_totals(
    endpoint: Endpoint, names: tuple[str, ...], settle_s: float = 0.2, max_s: float = 3.0
) -> dict[str, float] | None:
    """The totals once two reads `settle_s` apart agree on `names` (at most `max_s`): read right after
    a level's last stream ends, a server that publishes its engine's figures after the step that sent
    the last token (or on a timer) may not have counted all of the level yet."""
    last = read_totals(endpoint)
    deadline = time.monotonic() + max_s
    while last is not None and time.monotonic() < deadline:
        time.sleep(settle_s)
        now = read_totals(endpoint)
        if now is None or all(now.get(name) == last.get(name) for name in names):
            return now
        last = now
    return last


def first_token_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """The mean of each part of the time to first token (FIRST_TOKEN_PARTS) over the requests whose
    first token came between the two reads; a part the server does not expose, or no first token
    in between, is left out."""
    if before is None or after is None:
        return {}
    figures = {}
    for key, _, ours, vllms in FIRST_TOKEN_PARTS:
        for name in (ours, vllms):
            if name is None or f"{name}_count" not in after:
                continue
            count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
            total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
            if count > 0 and math.isfinite(total):
                figures[key] = total / count
            break
    return figures


def kernel_compile_figures(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float]:
    """{KERNEL_COMPILES_KEY: the variants compiled between the two reads}, or {} for a server without the
    counter (vLLM) or without a page."""
    if before is None or after is None or KERNEL_COMPILES_METRIC not in after:
        return {}
    return {KERNEL_COMPILES_KEY: after[KERNEL_COMPILES_METRIC] - before.get(KERNEL_COMPILES_METRIC, 0.0)}


def first_token_names() -> tuple[str, ...]:
    """The samples first_token_figures reads (for read_settled_totals)."""
    return tuple(
        f"{name}_{part}"
        for _, _, ours, vllms in FIRST_TOKEN_PARTS
        for name in (ours, vllms)
        if name is not None
        for part in ("count", "sum")
    )


def level_names() -> tuple[str, ...]:
    """The samples level_figures reads (for read_settled_totals around a level)."""
    return (*first_token_names(), KERNEL_COMPILES_METRIC)


def level_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """The server's own figures of a level between two reads of its totals: the parts of its time to
    first token and the kernel variants it compiled. One function for every caller (bench's suite,
    the perf tier), so a figure added here reaches each of their records."""
    return {**first_token_figures(before, after), **kernel_compile_figures(before, after)}


def describe_first_token(level: dict[str, float]) -> str:
    """ ", server TTFT mean 31.2 ms (to core 0.3, queued 1.0, prefill 29.4, delivery 0.5)" for a level
    with the server's split (the parts it has), "" for one without."""
    (total_key, total_label, _, _), *part_rows = FIRST_TOKEN_PARTS
    if total_key not in level:
        return ""
    parts = ", ".join(f"{label} {level[key] * 1e3:.1f}" for key, label, _, _ in part_rows if key in level)
    return f", {total_label} {level[total_key] * 1e3:.1f} ms" + (f" ({parts})" if parts else "")


def describe_kernel_compiles(level: dict[str, float]) -> str:
    """ ", 3 kernel compiles while serving" for a level in which the server compiled any, else ""."""
    compiles = level.get(KERNEL_COMPILES_KEY, 0.0)
    return f", {compiles:g} kernel compiles while serving" if compiles else ""

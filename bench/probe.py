"""Questions asked of the server before a run: which model, who are you, how far away, is the stream live.

The CLI calls `first_model` when --model is left out; the runner calls `probe` once per run and stores
its answer in run.json (`server`, `rtt`, `stream_check`).
"""

from __future__ import annotations

import asyncio
import statistics
import time

import aiohttp
import httpx

from bench.client import Endpoint, make_http_client, send_request
from bench.metrics import RequestRow
from bench.workload import Request


class ServerQueryError(RuntimeError):
    """A question to the server went unanswered (refused, timed out, an error status, or a body that is
    not the OpenAI list): the CLI says so in one line, with the URL asked, instead of a traceback."""


def first_model(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first id listed by `GET {base_url}/models`; ServerQueryError when there is none to read."""
    url = f"{base_url.rstrip('/')}/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url, headers=headers, timeout=timeout_s)
        response.raise_for_status()
        body = response.json()
    except httpx.HTTPStatusError as exc:
        raise ServerQueryError(
            f"GET {url} answered {exc.response.status_code}: {exc.response.text[:200]}"
        ) from exc
    except httpx.HTTPError as exc:
        raise ServerQueryError(f"GET {url} failed ({type(exc).__name__}: {exc}): is the server up?") from exc
    except ValueError as exc:
        raise ServerQueryError(f"GET {url} answered something other than JSON") from exc
    models = body.get("data") if isinstance(body, dict) else None
    if not isinstance(models, list) or not models or not isinstance(models[0], dict) or "id" not in models[0]:
        raise ServerQueryError(f"{url} lists no model; pass --model")
    return str(models[0]["id"])


def probe(endpoint: Endpoint, rtt_samples: int = 5) -> dict[str, object]:
    """Self-description, round-trip time and streaming check, as stored in run.json."""
    return asyncio.run(_probe(endpoint, rtt_samples))


async def _probe(endpoint: Endpoint, rtt_samples: int) -> dict[str, object]:
    async with make_http_client(endpoint) as http:
        server = await describe_server(http, endpoint)
        rtt = await measure_rtt(http, endpoint, rtt_samples)
        stream = await check_streaming(http, endpoint)
    return {"server": server, "rtt": rtt, "stream_check": stream}


PROBE_TIMEOUT = aiohttp.ClientTimeout(total=10.0)


async def describe_server(http: aiohttp.ClientSession, endpoint: Endpoint) -> dict[str, object]:
    """`GET /version` as the server answers it (ours: name, version, model, device...; vLLM: version),
    else `GET {base_url}/models`; `{"source": ..., "body": ...}` either way, or an error note."""
    for source in (f"{endpoint.root_url}/version", f"{endpoint.base_url}/models"):
        try:
            async with http.get(source, timeout=PROBE_TIMEOUT) as response:
                if response.status == 200:
                    return {"source": source, "body": await response.json(content_type=None)}
        except (TimeoutError, aiohttp.ClientError, ValueError):
            continue
    return {"source": None, "body": None, "error": "neither /version nor /models answered"}


async def measure_rtt(http: aiohttp.ClientSession, endpoint: Endpoint, samples: int) -> dict[str, float]:
    """Round trips of `GET {base_url}/models` on a warm connection: min and median seconds."""
    times = []
    for _ in range(samples + 1):  # the first one opens the connection and is dropped
        start = time.monotonic()
        async with http.get(f"{endpoint.base_url}/models", timeout=PROBE_TIMEOUT) as response:
            await response.read()
        times.append(time.monotonic() - start)
    return {"rtt_min_s": min(times[1:]), "rtt_median_s": statistics.median(times[1:])}


async def check_streaming(
    http: aiohttp.ClientSession, endpoint: Endpoint, max_tokens: int = 32
) -> dict[str, object]:
    """Is the stream delivered as it is produced, or buffered by something on the way?

    One short request; `span_s` is first chunk -> last chunk and `elapsed_s` is sent -> done.
    "buffered": at least 4 chunks, the request took over 50 ms, and every chunk arrived in its last 5 %;
    "streaming": the chunks were spread over time; "inconclusive": too fast to tell, or it failed.
    """
    request = Request(index=-1, prompt=list(range(1000, 1016)), prompt_len=16, max_tokens=max_tokens)
    row = RequestRow("probe", "probe", None, None, 0, -1, True, 16, max_tokens, 0.0, 0.0)
    clock_zero = time.monotonic()
    await send_request(http, endpoint, request, row, clock_zero)
    span = sum(row.itls_s)
    elapsed = row.done_s - row.sent_s
    verdict = "inconclusive"
    if row.ok and row.chunks >= 4 and row.first_token_s is not None:
        decode = row.done_s - row.first_token_s
        if elapsed > 0.05 and span < 0.05 * elapsed and row.first_token_s - row.sent_s > 0.95 * elapsed:
            verdict = "buffered"
        elif span > 0 and decode > 0:
            verdict = "streaming"
    return {
        "verdict": verdict,
        "status": row.status,
        "chunks": row.chunks,
        "span_s": span,
        "elapsed_s": elapsed,
        "ttft_s": row.ttft_s,
    }

"""One streaming completion request over HTTP, turned into a `RequestRow`.

The runner calls `send_request` for every request of a level; it speaks the OpenAI completions API
(`POST {base_url}/completions`) or, for a chat workload, the chat completions API (`POST
{base_url}/chat/completions`), both as SSE `data:` lines, so this project's server and vLLM are
measured through the very same code. Probes that describe the server before a run live in `bench.probe`.

The transport is aiohttp, as in vLLM's own benchmark client (`vllm bench serve`): its C parser reads a
streamed chunk for about a third of the CPU that httpx's pure-Python stack (httpcore, h11, anyio) took,
which at 32 streams of a chunk every 3 ms had kept the event loop busy enough to read chunks and send
new requests late (README: "Against `vllm bench serve`").
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import aiohttp

from bench.metrics import RequestRow
from bench.workload import Request


@dataclass(frozen=True)
class Endpoint:
    """Where to send requests. `base_url` ends with the API prefix, e.g. http://127.0.0.1:8000/v1."""

    base_url: str
    model: str
    target: str = ""
    api_key: str | None = None
    timeout_s: float = 600.0

    @property
    def root_url(self) -> str:
        """The server root (`base_url` without a trailing /v1), where `/version` lives."""
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


# Idle pooled connections are dropped after this long. uvicorn (ours and vLLM's) closes a connection
# idle for 5 s: a request sent on a connection the server is closing at that instant comes back reset
# without the server having seen it (with httpx's default 5-s expiry this hit ~2 requests a sweep
# against vLLM at the levels after a drain pause). Reconnecting over loopback costs ~0.1 ms, far under
# any latency measured here.
KEEPALIVE_EXPIRY_S = 1.0

# Client-side exceptions that mean the connection broke mid-request (reset, closed, truncated body).
STREAM_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def make_http_client(endpoint: Endpoint) -> aiohttp.ClientSession:
    """A session with no connection cap (in an open loop every due request must go out at once) that
    never reuses a connection the server may be about to close (KEEPALIVE_EXPIRY_S).

    `endpoint.timeout_s` bounds connecting and each wait for data, not a whole stream. Call it inside
    a running event loop (`async with make_http_client(endpoint) as http:`)."""
    headers = {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_EXPIRY_S)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=endpoint.timeout_s, sock_read=endpoint.timeout_s)
    return aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers, trust_env=True)


def request_path(request: Request) -> str:
    """Where a request goes under the API root: its workload's API."""
    return "/chat/completions" if request.api == "chat" else "/completions"


def request_body(model: str, request: Request) -> dict[str, object]:
    """The body both servers get: the workload's sampling (greedy unless it says otherwise), EOS
    ignored so every request generates its whole budget. A chat request carries its prompt as one
    user message, or its conversation so far (`max_tokens`, which both servers read as chat's
    max_completion_tokens)."""
    if request.api == "chat" and request.messages:  # a conversation so far (multi-turn)
        messages = [{"role": role, "content": content} for role, content in request.messages]
        prompt: dict[str, object] = {"messages": messages}
    elif request.api == "chat":
        text = request.prompt if isinstance(request.prompt, str) else None
        if text is None:
            raise ValueError("a chat request's prompt is text (WorkloadSpec sends text for the chat API)")
        prompt = {"messages": [{"role": "user", "content": text}]}
    else:
        prompt = {"prompt": request.prompt}
    return {
        "model": model,
        **prompt,
        "max_tokens": request.max_tokens,
        "temperature": request.temperature,
        **({"top_p": request.top_p} if request.top_p < 1 else {}),
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send_request(
    http: aiohttp.ClientSession,
    endpoint: Endpoint,
    request: Request,
    row: RequestRow,
    clock_zero: float,
) -> RequestRow:
    """Stream one completion and fill `row` (whose identity and scheduled_s the caller set) in place.

    Times are `time.monotonic() - clock_zero`. Every network read is stamped once; each chunk that
    carries a choice counts as one arrival (a busy server may pack several tokens in a chunk); in a
    chat stream, only a chunk whose `delta.content` is not empty (`is_arrival`). Output tokens come
    from the final `usage` when the server sends it, else from the number of arrivals. A request
    never raises: failures become `status` and `error` on the row.
    """
    body = request_body(endpoint.model, request)
    chat = request.api == "chat"
    row.sent_s = time.monotonic() - clock_zero
    usage_tokens: int | None = None
    last_chunk: float | None = None
    saw_done = False
    try:
        async with http.post(f"{endpoint.base_url}{request_path(request)}", json=body) as response:
            if response.status != 200:
                text = (await response.read()).decode(errors="replace")
                return _fail(row, f"http_{response.status}", text[:500], clock_zero)
            pending = b""
            async for data in response.content.iter_any():
                now = time.monotonic() - clock_zero
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for line in lines:
                    if not line.startswith(b"data:"):
                        continue  # blank separators, comments, event: fields
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        saw_done = True
                        continue
                    event = json.loads(payload)
                    if "error" in event and not event.get("choices"):
                        return _fail(row, "server_error", json.dumps(event["error"])[:500], clock_zero)
                    if is_arrival(event, chat):
                        row.chunks += 1
                        if last_chunk is None:
                            row.first_token_s = now
                        else:
                            row.itls_s.append(now - last_chunk)
                        last_chunk = now
                    usage = event.get("usage")
                    if usage:
                        usage_tokens = usage.get("completion_tokens")
                        row.usage_prompt_tokens = usage.get("prompt_tokens")
    except TimeoutError as exc:  # aiohttp's connect and read timeouts derive from it
        return _fail(row, "timeout", repr(exc), clock_zero)
    except aiohttp.ClientConnectorError as exc:
        return _fail(row, "connect", repr(exc), clock_zero)
    except STREAM_ERRORS as exc:
        return _fail(row, "stream_error", repr(exc), clock_zero)
    except Exception as exc:  # a malformed chunk or anything else: kept as a failed row
        return _fail(row, "error", repr(exc), clock_zero)
    row.done_s = time.monotonic() - clock_zero
    row.output_tokens = usage_tokens if usage_tokens is not None else row.chunks
    if not saw_done:
        row.status, row.error = "no_done", "stream ended without data: [DONE]"
    elif row.output_tokens < request.max_tokens:
        row.status = "short"
        row.error = f"got {row.output_tokens} of {request.max_tokens} tokens"
    return row


def is_arrival(event: dict, chat: bool) -> bool:
    """Whether a streamed event brings output. Completions: any chunk with a choice (even with empty
    text, as before). Chat: a chunk whose first choice's `delta.content` is not empty; the first chunk
    carries the role only (our server sends it before any token), and the last ones may carry only a
    finish_reason or the usage, so TTFT is the first chunk with content, as a chat user sees it."""
    choices = event.get("choices")
    if not choices:
        return False
    if not chat:
        return True
    delta = choices[0].get("delta") or {}
    return bool(delta.get("content"))


def _fail(row: RequestRow, kind: str, error: str, clock_zero: float) -> RequestRow:
    row.done_s = time.monotonic() - clock_zero
    row.output_tokens = row.output_tokens or row.chunks
    row.status, row.error = kind, error
    return row

"""ASGI middleware in front of the app: the API key check and the request size limit.

`create_app` wraps its FastAPI app in both when they are configured. Each answers with the OpenAI
error body (errors.py) before any handler runs: 401 for a missing or wrong key on a `/v1/` route
(or /reset_prefix_cache),
413 for a body over the limit, from its Content-Length or, for a chunked body, as soon as the bytes
read pass the limit (never after reading it whole).
"""

from __future__ import annotations

import hashlib
import hmac

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import error_response

PROTECTED_PREFIX = "/v1/"  # /health, /metrics, /version (and the OpenAPI document) stay open
# Outside /v1/ but not for anyone: flushing the prefix cache slows every request that follows.
PROTECTED_PATHS = frozenset({"/reset_prefix_cache"})
DEFAULT_MAX_REQUEST_BYTES = 16 << 20  # 512 prompts of 4,096 token ids written as JSON take ~12 MiB


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class APIKeyMiddleware:
    """Every `/v1/` request (and /reset_prefix_cache) must carry `Authorization: Bearer <key>`.

    Both sides are hashed before `hmac.compare_digest`, so the time taken says nothing about the key,
    not even its length.
    """

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self._expected = _digest(api_key.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path.startswith(PROTECTED_PREFIX) or path in PROTECTED_PATHS):
            await self.app(scope, receive, send)
            return
        authorization = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value
                break
        scheme, _, token = authorization.partition(b" ")
        given = token.strip() if scheme.lower() == b"bearer" else b""
        if given and hmac.compare_digest(_digest(given), self._expected):
            await self.app(scope, receive, send)
            return
        message = "missing API key: send Authorization: Bearer <key>" if not given else "invalid API key"
        response = error_response(401, message, None, {"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class RequestSizeMiddleware:
    """Bodies over `max_bytes` get 413: at once from Content-Length, else while being read."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _message(self) -> str:
        return f"the request body is larger than {self.max_bytes} bytes (--max-request-bytes)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit() or int(value) > self.max_bytes:
                    await error_response(413, self._message())(scope, receive, send)
                    return
                break
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    # Raised inside the handler's body read: the app's HTTPException handler answers.
                    raise HTTPException(413, self._message())
            return message

        await self.app(scope, limited_receive, send)

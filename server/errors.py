"""OpenAI-style error bodies, `{"error": {"message", "type", "param", "code"}}`, for every failure.

Handlers raise `APIError` (or let the engine's InvalidRequestError through); `install_error_handlers`
maps those, FastAPI's validation errors (400, never 422), HTTP errors and anything unexpected (500,
logged) onto that body. `type` and `code` follow vLLM: the error class name and the HTTP status.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine import InvalidRequestError

logger = logging.getLogger(__name__)

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
RETRY_AFTER_SECONDS = 1


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {"message": message, "type": _TYPES.get(status, "APIError"), "param": param, "code": status}
    }


def error_response(
    status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def overloaded(message: str) -> APIError:
    return APIError(503, message, None, {"Retry-After": str(RETRY_AFTER_SECONDS)})


def _validation_error(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first error, as a message and the top-level body field it concerns."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc = [part for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return (
            f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}",
            None,
        )
    if not loc:
        if first.get("type") == "missing":
            return "the request body is missing: send a JSON object", None
        return f"the request body must be a JSON object: {first.get('msg')}", None
    param = str(loc[0])
    where = ".".join(str(part) for part in loc)
    return f"{where}: {first.get('msg')} (got {_short(first.get('input'))})", param


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param, exc.headers)

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, exc.message, exc.param)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_error(exc)
        return error_response(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail), None, getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error: {type(exc).__name__}", None)

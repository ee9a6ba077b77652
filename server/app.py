"""The FastAPI app: `create_app(core, ...)` serves a running engine core in OpenAI-compatible endpoints.

Handlers are thin: schema in (protocol.py), the chat template, tokenization and validation here, in
the API process; token ids and SamplingParams out to the engine core's process (async_engine.py);
outputs back, detokenized here, as one JSON body or one SSE event per engine step. Errors take
OpenAI's shape (errors.py); /metrics renders metrics.py's registry.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send
from transformers import AutoTokenizer

import engine as engine_package
from engine import InvalidRequestError, RequestOutput, SamplingParams
from engine.core_process import CoreHandle
from engine.sampling_params import choice_seed
from engine.validation import RequestValidator
from server.async_engine import AdmissionError, AsyncEngine, EngineLoopError, RequestStream
from server.errors import (
    APIError,
    bad_request,
    error_body,
    error_response,
    install_error_handlers,
    overloaded,
)
from server.guards import DEFAULT_MAX_REQUEST_BYTES, APIKeyMiddleware, RequestSizeMiddleware
from server.metrics import CONTENT_TYPE, ServerMetrics
from server.protocol import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    DONE_EVENT,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChunkEncoder,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    ModelCard,
    ModelList,
    Usage,
    sse_event,
)

logger = logging.getLogger(__name__)

SERVER_NAME = "paged-engine"


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True) -> str:
    """The tokenizer's chat template, or when it has none the plain default:
    one "role: content" line per message, then "assistant:" to prompt the reply."""
    plain = [{"role": m.role, "content": m.text()} for m in messages]
    if getattr(tokenizer, "chat_template", None):
        try:
            return tokenizer.apply_chat_template(
                plain, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        except Exception as error:  # jinja templates raise for inputs they refuse (e.g. role order)
            raise bad_request(
                f"the chat template cannot render these messages: {error}", "messages"
            ) from error
    text = "".join(f"{m['role']}: {m['content']}\n" for m in plain)
    return text + "assistant:" if add_generation_prompt else text


def _check_unicode(text: str, param: str) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which the tokenizer cannot take: a 400, not a 500."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(
            f"{param} is not valid Unicode: lone surrogate at position {error.start}", param
        ) from error


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its engine requests however it ends (done, disconnect, error)."""

    def __init__(self, content: AsyncIterator[bytes], stream: RequestStream) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.abort()  # no-op for requests that finished


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(stream: RequestStream) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * len(stream.request_ids)
    async for index, output in stream:
        if output.finished:
            finals[index] = output
    return [f for f in finals if f is not None]


class _Server:
    """The state the handlers share: the validator, the engine core's handle, the served name, the
    metrics."""

    def __init__(
        self,
        validator: RequestValidator,
        model_name: str,
        async_engine: AsyncEngine,
        metrics: ServerMetrics,
    ) -> None:
        self.validator = validator
        self.model_name = model_name
        self.async_engine = async_engine
        self.metrics = metrics

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist.", "model")

    def check_admission(self, prompts: int, n: int) -> None:
        """Fail fast, before tokenizing, on what this process knows of `prompts` x `n` requests (a
        batch that could never fit is a 400 naming `n` where n > 1, else the prompt); the core, which
        sees every API process's requests, decides when `submit` sends them."""
        try:
            self.async_engine.check_admission(prompts * n, "n" if n > 1 else "prompt")
        except AdmissionError as error:
            raise self._rejected(error) from error

    def _rejected(self, error: AdmissionError) -> APIError:
        self.metrics.requests_rejected.inc()
        return overloaded(str(error))

    async def tokenize(
        self, prompts: list[str | list[int]], params: SamplingParams, param: str = "prompt"
    ) -> list[list[int]]:
        """Validate each prompt (raises InvalidRequestError naming the field).

        Token-id prompts are only checked (cheap) on the event loop; text goes to a worker thread so
        that tokenizing a long prompt does not hold up other clients' SSE writes.
        """
        for prompt in prompts:
            if isinstance(prompt, str):
                _check_unicode(prompt, param)
        if all(isinstance(p, list) for p in prompts):
            return [self.validator.validate(p, params) for p in prompts]
        return await asyncio.to_thread(lambda: [self.validator.validate(p, params) for p in prompts])

    async def submit(
        self, request_id: str, token_lists: list[list[int]], params: SamplingParams, n: int
    ) -> RequestStream:
        """Send `n` requests (choices) for each prompt and wait for the core to admit them: a refusal is
        still a 503 (over the limit, counted over every API process), a 400 or a 500, not an error
        inside a stream. A prompt's choices are consecutive (choice index = prompt x n + j, as
        OpenAI's and vLLM's servers number them); with a seed, choice j draws with seed + j (as vLLM
        does), so that each is reproducible alone and the choices differ."""
        requests = [ids for ids in token_lists for _ in range(n)]
        seeds = None
        if n > 1 and params.seed is not None:
            seeds = [choice_seed(params.seed, j) for _ in token_lists for j in range(n)]
        try:
            stream = self.async_engine.add(request_id, requests, params, seeds)
            await stream.admitted()
        except AdmissionError as error:
            raise self._rejected(error) from error
        except EngineLoopError as error:
            raise APIError(500, str(error)) from error
        return stream

    async def run(
        self,
        request: Request,
        kind: Literal["completion", "chat"],
        response_id: str,
        token_lists: list[list[int]],
        params: SamplingParams,
        stream: bool,
        include_usage: bool,
        n: int = 1,
    ) -> Response:
        engine_stream = await self.submit(response_id, token_lists, params, n)
        num_prompt_tokens = sum(len(ids) for ids in token_lists)  # each prompt once, whatever n
        if stream:
            encoder = ChunkEncoder(kind, response_id, self.model_name, int(time.time()))
            return EngineStreamingResponse(
                _events(engine_stream, encoder, num_prompt_tokens, include_usage), engine_stream
            )
        finals = await self._collect_unless_disconnected(request, engine_stream)
        if finals is None:
            return Response(status_code=499)  # nobody is listening
        usage = Usage.of(num_prompt_tokens, sum(len(f.token_ids) for f in finals))
        if kind == "completion":
            choices = [
                CompletionChoice(index=i, text=f.text, finish_reason=f.finish_reason)
                for i, f in enumerate(finals)
            ]
            body: Any = CompletionResponse(
                id=response_id, model=self.model_name, choices=choices, usage=usage
            )
        else:
            chat_choices = [
                ChatChoice(index=i, message=AssistantMessage(content=f.text), finish_reason=f.finish_reason)
                for i, f in enumerate(finals)
            ]
            body = ChatCompletionResponse(
                id=response_id, model=self.model_name, choices=chat_choices, usage=usage
            )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _collect_unless_disconnected(
        self, request: Request, stream: RequestStream
    ) -> list[RequestOutput] | None:
        """The final outputs, or None (requests aborted) if the client goes away first."""
        collect = asyncio.ensure_future(_collect(stream))
        watch = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            await asyncio.wait({collect, watch}, return_when=asyncio.FIRST_COMPLETED)
            if collect.done():
                try:
                    return collect.result()
                except EngineLoopError as error:
                    raise APIError(500, str(error)) from error
            return None
        finally:
            watch.cancel()
            if not collect.done():
                collect.cancel()
            stream.abort()


async def _events(
    stream: RequestStream, encoder: ChunkEncoder, num_prompt_tokens: int, include_usage: bool
) -> AsyncIterator[bytes]:
    """One SSE event per engine step per request; chat opens each choice with the role delta."""
    num_generated = 0
    if encoder.kind == "chat":
        for index in range(len(stream.request_ids)):
            yield encoder.role_chunk(index)
    try:
        async for index, output in stream:
            num_generated += len(output.new_token_ids)
            yield encoder.chunk(index, output.new_text, output.finish_reason if output.finished else None)
    except InvalidRequestError as error:
        yield sse_event(error_body(400, error.message, error.param))
    except EngineLoopError as error:
        yield sse_event(error_body(500, str(error)))
    else:
        if include_usage:
            yield encoder.usage_chunk(Usage.of(num_prompt_tokens, num_generated))
    yield DONE_EVENT


def create_app(
    core: CoreHandle,
    served_model_name: str | None = None,
    max_pending: int | None = None,
    shutdown_timeout: float = 30.0,
    api_key: str | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """An app serving the engine `core` (started by its caller, who also stops it); its lifespan
    connects to the core and on shutdown drains this app's requests and disconnects. `metrics`: one
    of several API processes passes its multiprocess-mode ServerMetrics.

    With `api_key`, every `/v1/` route needs `Authorization: Bearer <api_key>` (guards.py).
    """
    info = core.info
    tokenizer = load_tokenizer(info.model)
    validator = RequestValidator(tokenizer, info.vocab_size, info.max_model_len)
    metrics = metrics or ServerMetrics()
    async_engine = AsyncEngine(core, tokenizer, max_pending=max_pending, observer=metrics)
    server = _Server(validator, served_model_name or info.model, async_engine, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await async_engine.start()
        try:
            yield
        finally:
            await async_engine.drain(shutdown_timeout)
            await async_engine.stop()

    app = FastAPI(title=SERVER_NAME, version=engine_package.__version__, lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.served_model_name = server.model_name
    install_error_handlers(app)
    app.add_middleware(RequestSizeMiddleware, max_bytes=max_request_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)  # added last: runs first, so 401 before 413

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        body.check_supported()
        prompts = body.prompts()
        server.check_admission(len(prompts), body.choices)
        params = body.sampling_params(
            DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        )
        token_lists = await server.tokenize(prompts, params)
        return await server.run(
            request,
            "completion",
            f"cmpl-{uuid.uuid4().hex}",
            token_lists,
            params,
            body.stream,
            body.include_usage,
            body.choices,
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        server.check_model(body.model)
        body.check_supported()
        server.check_admission(1, body.choices)
        prompt = render_chat(tokenizer, body.messages, body.add_generation_prompt)
        max_tokens = body.requested_max_tokens
        params = body.sampling_params(1 if max_tokens is None else max_tokens)
        [token_ids] = await server.tokenize([prompt], params, "messages")
        if max_tokens is None:  # as in vLLM: whatever the context leaves
            params.max_tokens = info.max_model_len - len(token_ids)
        return await server.run(
            request,
            "chat",
            f"chatcmpl-{uuid.uuid4().hex}",
            [token_ids],
            params,
            body.stream,
            body.include_usage,
            body.choices,
        )

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(
            data=[ModelCard(id=server.model_name, root=info.model, max_model_len=info.max_model_len)]
        )

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_alive:
            return error_response(503, "the engine core is not running")
        if not async_engine.accepting:
            return error_response(503, "the server is shutting down", headers={"Retry-After": "1"})
        return JSONResponse({"status": "ok"})

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {
            "name": SERVER_NAME,
            "version": engine_package.__version__,
            "model": server.model_name,
            "device": info.device,
            "gpu": info.gpu_name,
            "config": info.config,
        }

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, int]:
        """Forget the cached prefix blocks (vLLM serves this path with VLLM_SERVER_DEV_MODE=1), so a
        benchmark level that repeats prompts starts cold; running requests go on."""
        try:
            return {"freed_blocks": await async_engine.reset_prefix_cache()}
        except AdmissionError as error:
            raise overloaded(str(error)) from error

    return app


@functools.cache
def load_tokenizer(model: str) -> Any:
    """The model's tokenizer, loaded once per process (apps of one process share it: it is only read)."""
    return AutoTokenizer.from_pretrained(model)

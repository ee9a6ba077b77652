"""Request and response schemas in OpenAI's shape (as vLLM accepts them), and the SSE chunk encoders.

Requests are pydantic models that ignore unknown fields but reject wrong types of known ones; they
turn themselves into engine SamplingParams. Streaming chunks are written from precomputed byte
prefixes, so each event costs O(its delta), whatever the length of the output so far.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr

from engine import SamplingParams
from server.errors import bad_request

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # the most choices (`n`) one request may ask for, as OpenAI's API allows


class _Schema(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Schema):
    include_usage: bool | None = False


class _SamplingRequest(_Schema):
    """Fields shared by completions and chat; None means the default."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extra sampling fields: top_k, min_p, repetition_penalty
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None

    def check_supported(self) -> None:
        """Refuse, naming the field, what the engine cannot honour (rather than silently ignore it)."""
        if self.n is not None and not 1 <= self.n <= MAX_CHOICES:
            raise bad_request(f"n must be an integer in [1, {MAX_CHOICES}], got {self.n}", "n")

    @property
    def choices(self) -> int:
        """How many choices to generate for each prompt (`n`)."""
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
            frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


# A string, token ids, or a batch of either.
Prompt = StrictStr | list[StrictInt] | list[StrictStr] | list[list[StrictInt]]


class CompletionRequest(_SamplingRequest):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None:
            raise bad_request("logprobs are not supported", "logprobs")
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of=1 is supported", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a batch is a non-empty list of strings or of lists."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], str | list):
            return list(prompt)  # type: ignore[arg-type]
        return [prompt]  # type: ignore[list-item]


class TextContentPart(_Schema):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Schema):
    role: StrictStr
    content: StrictStr | list[TextContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise bad_request("messages must hold at least one message", "messages")
        if self.logprobs:
            raise bad_request("logprobs are not supported", "logprobs")
        if self.top_logprobs:
            raise bad_request("top_logprobs are not supported", "top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# -- responses --------------------------------------------------------------------------------
class Usage(_Schema):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionChoice(_Schema):
    index: int
    text: str
    logprobs: None = None
    finish_reason: str | None


class CompletionResponse(_Schema):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(_Schema):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Schema):
    index: int
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None


class ChatCompletionResponse(_Schema):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(_Schema):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "paged-engine"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Schema):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- streaming --------------------------------------------------------------------------------
DONE_EVENT = b"data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _finish(reason: str | None) -> bytes:
    return b"null" if reason is None else json.dumps(reason).encode()


class ChunkEncoder:
    """SSE events of one streaming response; `kind` is "completion" or "chat"."""

    def __init__(
        self, kind: Literal["completion", "chat"], response_id: str, model: str, created: int
    ) -> None:
        self.kind = kind
        self.response_id = response_id
        self.model = model
        self.created = created
        obj = "text_completion" if kind == "completion" else "chat.completion.chunk"
        head = f'data: {{"id":{json.dumps(response_id)},"object":"{obj}","created":{created},"model":{json.dumps(model)},'
        self._head = head.encode()
        self._choice_head = self._head + b'"choices":[{"index":'

    def chunk(self, index: int, text: str, finish_reason: str | None) -> bytes:
        if self.kind == "completion":
            body = b',"text":' + json.dumps(text).encode()
        else:
            body = (
                b',"delta":{"content":' + json.dumps(text).encode() + b"}"
                if text or finish_reason is None
                else b',"delta":{}'
            )
        return (
            self._choice_head
            + str(index).encode()
            + body
            + b',"logprobs":null,"finish_reason":'
            + _finish(finish_reason)
            + b"}]}\n\n"
        )

    def role_chunk(self, index: int) -> bytes:
        return (
            self._choice_head
            + str(index).encode()
            + b',"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def usage_chunk(self, usage: Usage) -> bytes:
        return self._head + b'"choices":[],"usage":' + usage.model_dump_json().encode() + b"}\n\n"

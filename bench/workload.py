"""Workloads: what each request asks for, and when it arrives.

`make_request(spec, index)` builds request `index` of a workload deterministically from the seed, so
any worker process can build its own share; `arrival_offsets` gives the open-loop schedule.
The runner calls both; nothing here does I/O except reading a `--dataset` file. Two workloads share
prompt prefixes, for servers with a prefix cache: `shared-prefix` (one of K prefixes, then a unique
suffix) and `multi-turn` (recorded conversations, each turn resending the conversation so far).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np

SEED_MIX_PROMPT_LENS = (16, 64, 256, 1024, 4096)
SEED_MIX_OUTPUT_LENS = (64, 128, 256)
# The sampled variant of a workload: what a typical chat client sends (the OpenAI API's default
# temperature, a nucleus of 0.95).
SAMPLED = {"temperature": 1.0, "top_p": 0.95}

# Streams of the seed: request contents and arrival gaps draw from independent generators, so changing
# the rate never changes which prompts are sent.
_PROMPT_STREAM = 0
_ARRIVAL_STREAM = 1
_PREFIX_STREAM = 2  # shared-prefix: prefix j's ids
_CONVERSATION_STREAM = 3  # multi-turn: conversation c's turns and recorded replies

WorkloadKind = Literal["seed-mix", "fixed", "jsonl", "shared-prefix", "multi-turn"]
PREFIX_KINDS = ("shared-prefix", "multi-turn")
Arrival = Literal["constant", "poisson"]
# How a prompt is sent: the token ids themselves, or text of the same token length made from the
# model's tokenizer (bench.prompts), which the server then tokenizes as a user's text.
PromptFormat = Literal["token-ids", "text"]
# Which OpenAI API carries it: /v1/completions (a prompt), or /v1/chat/completions (the prompt as one
# user message, through the server's chat template).
Api = Literal["completions", "chat"]


@dataclass(frozen=True)
class WorkloadSpec:
    """Which prompts to send. `token_range` is half-open: ids in [low, high)."""

    kind: WorkloadKind = "seed-mix"
    seed: int = 0
    token_range: tuple[int, int] = (1000, 30000)
    input_len: int = 128  # fixed only
    output_len: int = 128  # fixed only
    dataset: str | None = None  # jsonl only
    # How every request of the workload samples: greedy (temperature 0) by default, as the stored
    # baselines were measured; SAMPLED is what a typical chat client sends.
    temperature: float = 0.0
    top_p: float = 1.0
    # Text prompts of each request's token length (seed-mix, fixed), made with `tokenizer`, the model
    # folder whose tokenizer the server uses; a chat request's message is sized so that the prompt the
    # server counts, chat template included, has that length.
    prompt_format: PromptFormat = "token-ids"
    api: Api = "completions"
    tokenizer: str | None = None
    # shared-prefix: request i is prefix (i mod num_prefixes) of prefix_len tokens, then a suffix of
    # suffix_len tokens of its own; output_len tokens each (the shape of `vllm bench serve --dataset-name
    # prefix_repetition`). multi-turn: `conversations` conversations of `turns` turns, the first user
    # message prefix_len tokens, each later one suffix_len, each recorded reply output_len (also each
    # turn's budget); see make_request.
    num_prefixes: int = 16
    prefix_len: int = 2048
    suffix_len: int = 128
    turns: int = 4
    conversations: int = 32

    def __post_init__(self) -> None:
        low, high = self.token_range
        if not 0 <= low < high:
            raise ValueError(f"token_range must satisfy 0 <= low < high, got {self.token_range}")
        if self.kind == "jsonl" and not self.dataset:
            raise ValueError("the jsonl workload needs a dataset file")
        if self.kind == "fixed" and (self.input_len < 1 or self.output_len < 1):
            raise ValueError("fixed workload needs input_len >= 1 and output_len >= 1")
        if not self.temperature >= 0:  # NaN fails too
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.prompt_format not in ("token-ids", "text"):
            raise ValueError(f"prompt_format must be token-ids or text, got {self.prompt_format!r}")
        if self.api not in ("completions", "chat"):
            raise ValueError(f"api must be completions or chat, got {self.api!r}")
        if self.kind in PREFIX_KINDS:
            if self.prompt_format == "text" or (self.api == "chat" and self.kind == "shared-prefix"):
                raise ValueError(
                    f"the {self.kind} workload sends token ids to /v1/completions (multi-turn also chat "
                    "messages): a prefix shared in token ids is shared exactly, text re-tokenized at a "
                    "join need not be"
                )
            sizes = {"prefix_len": self.prefix_len, "suffix_len": self.suffix_len}
            sizes |= {"output_len": self.output_len, "num_prefixes": self.num_prefixes}
            sizes |= {"turns": self.turns, "conversations": self.conversations}
            if small := [name for name, value in sizes.items() if value < 1]:
                raise ValueError(f"the {self.kind} workload needs {', '.join(small)} >= 1")
        if self.sends_text and self.kind != "jsonl" and not self.tokenizer:
            raise ValueError(
                "text prompts (prompt_format text, or the chat API) are made with the model's tokenizer: "
                "give its folder (tokenizer)"
            )

    @property
    def sampled(self) -> bool:
        return self.temperature > 0

    @property
    def sends_text(self) -> bool:
        """Whether prompts go out as text: asked for, or needed by the chat API (a message is text)."""
        return self.prompt_format == "text" or self.api == "chat"

    @property
    def exact_prompt_lens(self) -> bool:
        """Whether each request's `prompt_len` is the token count the server should report: every
        workload but jsonl, whose prompt_len counts whitespace words."""
        return self.kind != "jsonl"


@dataclass(frozen=True)
class Request:
    """One request of a workload. `prompt` is token ids (seed-mix, fixed) or text (jsonl, and any
    workload with text prompts); with the chat API it is the user message."""

    index: int
    prompt: list[int] | str
    prompt_len: int  # tokens the server should count (jsonl: whitespace words of the prompt)
    max_tokens: int
    temperature: float = 0.0  # the workload's sampling (WorkloadSpec)
    top_p: float = 1.0
    api: Api = "completions"
    # A chat conversation so far, (role, content) each, when the request is more than one message
    # (multi-turn over the chat API); `prompt` is then its last user message.
    messages: tuple[tuple[str, str], ...] = ()


def make_request(spec: WorkloadSpec, index: int) -> Request:
    """Request number `index` of the workload; the same (spec, index) always gives the same request."""
    if spec.kind == "jsonl":
        entries = load_dataset(spec.dataset or "")
        prompt, max_tokens = entries[index % len(entries)]
        return Request(index, prompt, len(prompt.split()), max_tokens, spec.temperature, spec.top_p, spec.api)
    if spec.kind == "shared-prefix":
        return _shared_prefix_request(spec, index)
    if spec.kind == "multi-turn":
        return _turn_request(spec, index)
    if spec.sends_text:
        return _text_request(spec, index)
    rng = np.random.default_rng([spec.seed, _PROMPT_STREAM, index])
    prompt_len, max_tokens, token_ids = _draw(spec, rng)
    return Request(index, token_ids, prompt_len, max_tokens, spec.temperature, spec.top_p, spec.api)


def _draw(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[int, int, list[int]]:
    """(prompt_len, max_tokens, prompt token ids) of a seed-mix or fixed request, from its generator."""
    if spec.kind == "seed-mix":
        prompt_len = int(rng.choice(SEED_MIX_PROMPT_LENS))
        max_tokens = int(rng.choice(SEED_MIX_OUTPUT_LENS))
    elif spec.kind == "fixed":
        prompt_len, max_tokens = spec.input_len, spec.output_len
    else:
        raise ValueError(f"unknown workload {spec.kind!r}")
    low, high = spec.token_range
    return prompt_len, max_tokens, rng.integers(low, high, size=prompt_len).tolist()


def _ids(spec: WorkloadSpec, key: list[int], count: int) -> list[int]:
    low, high = spec.token_range
    return np.random.default_rng([spec.seed, *key]).integers(low, high, size=count).tolist()


def _shared_prefix_request(spec: WorkloadSpec, index: int) -> Request:
    """Prefix `index mod num_prefixes` (its ids fixed by the seed and its number), then a suffix of this
    request's own: the K prefixes take turns, so each is sent equally often."""
    prefix = _prefix_ids(spec, index % spec.num_prefixes)
    suffix = _ids(spec, [_PROMPT_STREAM, index], spec.suffix_len)
    prompt_len = spec.prefix_len + spec.suffix_len
    return Request(index, prefix + suffix, prompt_len, spec.output_len, spec.temperature, spec.top_p)


@lru_cache(maxsize=64)
def _prefix_ids(spec: WorkloadSpec, number: int) -> list[int]:
    return _ids(spec, [_PREFIX_STREAM, number], spec.prefix_len)


def conversation_turn(spec: WorkloadSpec, index: int) -> tuple[int, int]:
    """(conversation, turn) of request `index` in a multi-turn workload.

    Requests go round the conversations of a round: the first `conversations` requests are each one's
    first turn, the next as many their second turn, and so on for `turns` turns; then a new round of
    conversations begins. So a turn goes out `conversations` requests after the turn before it: with
    `conversations` at least the requests in flight, that turn has usually finished, and its prompt
    (the new turn's prefix) is in the cache, as when a user answers a reply. Example, 2 conversations
    of 3 turns: indices 0..5 are (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2); index 6 is (2, 0)."""
    per_round = spec.conversations * spec.turns
    round_number, within = divmod(index, per_round)
    turn, member = divmod(within, spec.conversations)
    return round_number * spec.conversations + member, turn


def _turn_request(spec: WorkloadSpec, index: int) -> Request:
    """Turn t of a recorded conversation: its first user message (prefix_len ids), then for each
    earlier turn the recorded reply (output_len ids) and the next user message (suffix_len ids). The
    replies are part of the workload, not what the server generated, so every server receives the same
    requests and their cache hit rates can be compared; each turn's budget is a reply's length."""
    if spec.api == "chat":
        return _chat_turn_request(spec, index)
    conversation, turn = conversation_turn(spec, index)
    ids = _ids(spec, [_CONVERSATION_STREAM, conversation, 0, 0], spec.prefix_len)
    for k in range(1, turn + 1):
        ids += _ids(spec, [_CONVERSATION_STREAM, conversation, k, 1], spec.output_len)  # reply k-1
        ids += _ids(spec, [_CONVERSATION_STREAM, conversation, k, 0], spec.suffix_len)  # user k
    prompt_len = spec.prefix_len + turn * (spec.output_len + spec.suffix_len)
    return Request(index, ids, prompt_len, spec.output_len, spec.temperature, spec.top_p)


@lru_cache(maxsize=1 << 14)
def _chat_turn_request(spec: WorkloadSpec, index: int) -> Request:
    """Turn t of a recorded conversation over the chat API: the same parts as the token-id replay,
    each made text of its length with the model's tokenizer (bench.prompts), sent as alternating user
    and assistant messages; each turn's messages extend the turn before's, so the server's templated
    prompt of a turn begins with the one before it. `prompt_len` is what the tokenizer makes of the
    templated conversation (the parts' tokens alone without a chat template)."""
    from bench.prompts import load_tokenizer

    assert spec.tokenizer is not None
    conversation, turn = conversation_turn(spec, index)
    messages = [("user", _part_text(spec, conversation, 0, 0, spec.prefix_len))]
    for k in range(1, turn + 1):
        messages.append(("assistant", _part_text(spec, conversation, k, 1, spec.output_len)))
        messages.append(("user", _part_text(spec, conversation, k, 0, spec.suffix_len)))
    tokenizer = load_tokenizer(spec.tokenizer)
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(
            [{"role": role, "content": text} for role, text in messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        prompt_len = len(tokenizer.encode(rendered, add_special_tokens=False))
    else:
        prompt_len = spec.prefix_len + turn * (spec.output_len + spec.suffix_len)
    last = messages[-1][1]
    return Request(
        index, last, prompt_len, spec.output_len, spec.temperature, spec.top_p, "chat", tuple(messages)
    )


@lru_cache(maxsize=1 << 14)
def _part_text(spec: WorkloadSpec, conversation: int, turn: int, role: int, length: int) -> str:
    """One message of a chat replay: the token-id replay's ids for it, made text of their length."""
    from bench.prompts import load_tokenizer, text_prompt

    assert spec.tokenizer is not None
    rng = np.random.default_rng([spec.seed, _CONVERSATION_STREAM, conversation, turn, role])
    ids = rng.integers(spec.token_range[0], spec.token_range[1], size=length).tolist()
    return text_prompt(load_tokenizer(spec.tokenizer), ids, length, rng, spec.token_range).text


@lru_cache(maxsize=1 << 14)
def _text_request(spec: WorkloadSpec, index: int) -> Request:
    """The token-id request of the same (spec, index), its ids turned into text of its length
    (bench.prompts; the same generator tops up short texts, so the result is fixed by the seed).

    Kept: a 4,096-token prompt takes ~15 ms to decode and re-encode, and every level and trial sends
    the same indices again; the runner builds a level's requests before it starts (prebuild)."""
    from bench.prompts import chat_overhead, load_tokenizer, text_prompt

    assert spec.tokenizer is not None
    rng = np.random.default_rng([spec.seed, _PROMPT_STREAM, index])
    prompt_len, max_tokens, token_ids = _draw(spec, rng)
    overhead = chat_overhead(spec.tokenizer) if spec.api == "chat" else 0
    content = max(1, prompt_len - overhead)
    made = text_prompt(load_tokenizer(spec.tokenizer), token_ids[:content], content, rng, spec.token_range)
    # A chat prompt shorter than its template (the seed-mix's 16 tokens against ChatML's ~19) cannot
    # be made: it goes out as the template around one token, and is counted at that length.
    prompt_len = max(prompt_len, overhead + made.tokens)
    return Request(index, made.text, prompt_len, max_tokens, spec.temperature, spec.top_p, spec.api)


def arrival_offsets(
    rate: float,
    *,
    n: int | None = None,
    duration_s: float | None = None,
    arrival: Arrival = "poisson",
    burstiness: float = 1.0,
    seed: int = 0,
) -> list[float]:
    """Open-loop arrival times in seconds from the level's start; the first arrival is at 0.

    Gaps are gamma-distributed with shape `burstiness` and mean 1/rate (shape 1 is Poisson; below 1
    burstier, above 1 more regular); `constant` spaces them exactly 1/rate apart. The gaps for a seed
    are drawn once at unit rate and divided by `rate`, so two rates with one seed differ only in scale.
    Exactly one of `n` (that many arrivals) or `duration_s` (arrivals strictly before it) is given.
    """
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if burstiness <= 0:
        raise ValueError(f"burstiness must be > 0, got {burstiness}")
    if (n is None) == (duration_s is None):
        raise ValueError("give exactly one of n or duration_s")
    rng = np.random.default_rng([seed, _ARRIVAL_STREAM])

    def unit_gaps(count: int) -> np.ndarray:
        if arrival == "constant":
            return np.ones(count)
        if arrival == "poisson":
            return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=count)
        raise ValueError(f"unknown arrival process {arrival!r}")

    if n is not None:
        if n < 0:
            raise ValueError(f"n must be >= 0, got {n}")
        gaps = unit_gaps(max(n - 1, 0)) / rate
        return np.concatenate([[0.0], np.cumsum(gaps)])[:n].tolist()
    assert duration_s is not None
    offsets = [0.0]
    while True:  # draw in blocks so the sequence for a seed does not depend on the duration
        for gap in unit_gaps(1024) / rate:
            nxt = offsets[-1] + float(gap)
            if nxt >= duration_s:
                return offsets if duration_s > 0 else []
            offsets.append(nxt)


@lru_cache(maxsize=4)
def load_dataset(path: str) -> tuple[tuple[str, int], ...]:
    """Read (prompt text, max_tokens) pairs from a user's file.

    Two shapes are accepted, one JSON object per line or a single JSON array of them:
    `{"prompt": str, "max_tokens": int}`, or ShareGPT-style
    `{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}, ...]}`, where the
    prompt is the first human turn and the budget the first gpt turn's length in whitespace words.
    Entries without a usable prompt or budget are skipped; an empty result is an error.
    """
    text = Path(path).read_text(encoding="utf-8")
    stripped = text.lstrip()
    if stripped.startswith("["):
        records = json.loads(stripped)
    else:
        records = [json.loads(line) for line in text.splitlines() if line.strip()]
    entries = []
    for record in records:
        entry = _parse_record(record)
        if entry is not None:
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no usable entries (need prompt/max_tokens or ShareGPT conversations)")
    return tuple(entries)


def _parse_record(record: dict) -> tuple[str, int] | None:
    if "prompt" in record:
        prompt, max_tokens = record["prompt"], record.get("max_tokens")
    elif "conversations" in record:
        turns = record["conversations"]
        human = next((t["value"] for t in turns if t.get("from") == "human"), None)
        reply = next((t["value"] for t in turns if t.get("from") == "gpt"), None)
        if human is None or reply is None:
            return None
        prompt, max_tokens = human, len(reply.split())
    else:
        return None
    if not isinstance(prompt, str) or not prompt or not isinstance(max_tokens, int) or max_tokens < 1:
        return None
    return prompt, max_tokens

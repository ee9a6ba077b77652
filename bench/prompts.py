"""Text prompts of a target token length, made from the model's own tokenizer.

bench.workload calls `text_prompt` when a workload sends text (`prompt_format="text"`): the request's
random token ids are decoded, the text re-encoded, and the ids cut or topped up until the text encodes
to the target length, as `vllm bench serve`'s random dataset does. Decoding is not the inverse of
encoding (byte pieces merge, a lone byte becomes U+FFFD), so a few prompts may come out a token or
two short (never long: a prompt must fit the context its request was sized for); `TextPrompt.tokens`
says by how much, and the runner checks the server's `usage.prompt_tokens`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

# Decode/re-encode rounds before a prompt is taken as it is: random ids converge in one or two.
MAX_ROUNDS = 10


@lru_cache(maxsize=4)
def load_tokenizer(model_dir: str) -> Any:
    """The tokenizer of the model folder, loaded once per process (transformers' AutoTokenizer, as both
    servers load it)."""
    from transformers import AutoTokenizer  # slow to import: only workloads that send text pay for it

    return AutoTokenizer.from_pretrained(model_dir)


@dataclass(frozen=True)
class TextPrompt:
    """A prompt's text and how many tokens the tokenizer makes of it (without special tokens)."""

    text: str
    tokens: int


def text_prompt(
    tokenizer: Any, token_ids: list[int], target: int, rng: np.random.Generator, token_range: tuple[int, int]
) -> TextPrompt:
    """Text that encodes to `target` tokens (add_special_tokens=False, as our server encodes a text
    prompt), from `token_ids`: decode, re-encode; cut the ids when too long, top them up with ids drawn
    from `rng` in `token_range` (special tokens excluded) when too short; at most MAX_ROUNDS rounds,
    then cut until it is no longer than `target`. Deterministic for the same inputs and rng state."""
    if target < 1:
        raise ValueError(f"target must be >= 1 token, got {target}")
    specials = set(getattr(tokenizer, "all_special_ids", ()) or ())
    low, high = token_range
    ids = [t for t in token_ids if t not in specials]
    text = ""
    for _ in range(MAX_ROUNDS):
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == target:
            return TextPrompt(text, target)
        if len(ids) > target:
            ids = ids[:target]
        else:
            extra = rng.integers(low, high, size=target - len(ids)).tolist()
            ids += [t for t in extra if t not in specials]
    # Not settled: a prompt may come out shorter than asked, never longer. A request's prompt and
    # max_tokens are sized to fit the server's context (the seed-mix's longest fills it exactly), so
    # one token too many would turn it into a 400. Each round drops as many ids as there are tokens
    # too many.
    text = tokenizer.decode(ids)
    count = len(tokenizer.encode(text, add_special_tokens=False))
    while count > target and len(ids) > 1:
        ids = ids[: max(1, len(ids) - (count - target))]
        text = tokenizer.decode(ids)
        count = len(tokenizer.encode(text, add_special_tokens=False))
    return TextPrompt(text, count)


@lru_cache(maxsize=4)
def chat_overhead(model_dir: str) -> int:
    """Tokens a chat template adds around one user message (its role markers and the assistant's
    generation prompt), so a chat prompt can be sized to what the server counts; 0 without a template.

    Measured once per tokenizer on a one-word message: ChatML's markers are special tokens, which no
    message text merges with."""
    tokenizer = load_tokenizer(model_dir)
    if not getattr(tokenizer, "chat_template", None):
        return 0
    word = "hello"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": word}], tokenize=False, add_generation_prompt=True
    )
    whole = len(tokenizer.encode(rendered, add_special_tokens=False))
    return max(0, whole - len(tokenizer.encode(word, add_special_tokens=False)))

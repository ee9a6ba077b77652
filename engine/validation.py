"""Checking a request before it is scheduled: its sampling parameters, its prompt's tokens, its length.

Used by `LLMEngine` and by the server's API processes, which tokenize and validate before a request
reaches the engine core, so a bad request gets its 400 without costing the step loop anything.
"""

from __future__ import annotations

from typing import Any

from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams


class RequestValidator:
    """Thread-safe: holds only the tokenizer and two limits."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def validate(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and check a request; returns its token ids, or raises InvalidRequestError naming
        the field at fault."""
        params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequestError("prompt is empty", "prompt")
            token_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        elif isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt
        ):
            token_ids = list(prompt)
        else:
            raise InvalidRequestError("prompt must be a string or a list of token ids", "prompt")
        if not token_ids:
            raise InvalidRequestError("prompt is empty", "prompt")
        vocab = self.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"token id {bad[0]} is outside the vocabulary [0, {vocab})", "prompt")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's context of {self.max_model_len} tokens",
                "max_tokens" if len(token_ids) < self.max_model_len else "prompt",
            )
        return token_ids

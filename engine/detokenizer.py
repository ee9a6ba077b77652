"""Incremental detokenization and stop strings, one instance per request.

Byte-level tokens can split a UTF-8 character, so new text is released only once it decodes without a
replacement character. With a fast (Rust) tokenizer this runs through its `DecodeStream`, about eight
times cheaper per token than decoding two slices in Python, which matters at hundreds of sequences a
step; other tokenizers use the prefix/read offsets below. Stop strings cut the text exactly before the
first match; while a request runs, the last len(longest stop) - 1 characters are held back from the
stream, since they might be the start of a stop string.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_strings = stop_strings
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""
        self.stopped = False  # a stop string was found; text is final
        self._prefix_offset = 0
        self._read_offset = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None else None

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    def append(self, new_token_ids: list[int], final: bool = False) -> None:
        """Add tokens; when final, release whatever is left even if it ends mid-character."""
        if self.stopped:
            return
        self.token_ids.extend(new_token_ids)
        if self._stream is not None:
            self._append_streamed(new_token_ids, final)
            return
        prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self.token_ids[self._prefix_offset :])
        if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
            delta = full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self._add_text(delta)

    def _append_streamed(self, new_token_ids: list[int], final: bool) -> None:
        """The stream holds back a split character until it completes; at the end, release it anyway."""
        first = len(self.token_ids) - len(new_token_ids)
        for index, token in enumerate(new_token_ids, start=first + 1):
            piece = self._stream.step(self._backend, token)  # type: ignore[union-attr, arg-type]
            if piece:
                self._prefix_offset = self._read_offset
                self._read_offset = index
                self._add_text(piece)
                if self.stopped:
                    return
        if final and self._read_offset < len(self.token_ids):
            prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
            full_text = self._decode(self.token_ids[self._prefix_offset :])
            if len(full_text) > len(prefix_text):
                self._read_offset = len(self.token_ids)
                self._add_text(full_text[len(prefix_text) :])

    def _add_text(self, delta: str) -> None:
        if not self.stop_strings:
            self.text += delta
            return
        search_from = max(0, len(self.text) - self.holdback)
        self.text += delta
        found = [i for i in (self.text.find(s, search_from) for s in self.stop_strings) if i >= 0]
        if found:
            self.text = self.text[: min(found)]
            self.stopped = True

    def visible_text(self, finished: bool) -> str:
        """What may be shown now: all of it when finished, else all but the held-back tail."""
        if finished or self.stopped or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

"""The streamed detokenizer (the fast tokenizer's DecodeStream) ends with exactly the text of the
slice-decoding path, for any token ids split into any chunks, stop strings included, and what it
shows while streaming only ever grows (the two paths may hold an invalid byte back for different
spans, so only the final text is compared)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from engine.detokenizer import IncrementalDetokenizer


@given(data=st.data())
@settings(max_examples=150, deadline=None)
def test_streamed_text_equals_slice_decoding(tiny_model_dir, data):
    tokenizer = _tokenizer(tiny_model_dir)
    ids = data.draw(st.lists(st.integers(0, tokenizer.vocab_size - 1), min_size=1, max_size=40))
    stops = data.draw(st.sampled_from([(), ("a",), ("ab", "\n")]))
    streamed = IncrementalDetokenizer(tokenizer, stops)
    sliced = IncrementalDetokenizer(tokenizer, stops)
    assert streamed._stream is not None
    sliced._stream = None  # force the slice-decoding path
    position, shown = 0, ""
    while position < len(ids):
        size = data.draw(st.integers(1, 4))
        chunk, position = ids[position : position + size], position + size
        final = position >= len(ids)
        streamed.append(chunk, final=final)
        sliced.append(chunk, final=final)
        visible = streamed.visible_text(final)
        assert visible.startswith(shown)
        shown = visible
    assert streamed.text == sliced.text
    assert streamed.stopped == sliced.stopped


_cache: dict = {}


def _tokenizer(model_dir):
    if model_dir not in _cache:
        _cache[model_dir] = AutoTokenizer.from_pretrained(model_dir)
    return _cache[model_dir]

"""RequestStream: outputs reach the handler in order; one that arrives while the previous output of
the same request is still unread joins it (both deltas, the later totals), so a server that falls
behind the engine sends fewer, larger chunks; errors and other requests' outputs never merge."""

from __future__ import annotations

import pytest

from engine import RequestOutput
from server.async_engine import EngineLoopError, RequestStream


def output(request_id: str, ids: list[int], text: str, done: bool = False) -> RequestOutput:
    so_far = list(range(100, 100 + len(ids)))  # stands for the sequence's output list
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=[1, 2],
        new_token_ids=ids,
        text=text,
        new_text=text[-len(ids) :],
        finished=done,
        finish_reason="length" if done else None,
        _output_ref=so_far,
        _num_output_tokens=len(so_far),
    )


def stream(*request_ids: str) -> RequestStream:
    return RequestStream(owner=None, group_id="g", request_ids=list(request_ids))  # type: ignore[arg-type]  # never aborted here


async def read(s: RequestStream) -> list[tuple[int, RequestOutput]]:
    return [pair async for pair in s]


def test_followed_by_joins_deltas_and_keeps_the_later_totals():
    first, later = output("r", [7], "a"), output("r", [8, 9], "abc", done=True)
    joined = first.followed_by(later)
    assert (joined.new_token_ids, joined.new_text, joined.text) == ([7, 8, 9], "abc", "abc")
    assert (joined.finished, joined.finish_reason) == (True, "length")
    assert joined.token_ids == later.token_ids
    with pytest.raises(ValueError, match="not one request's"):
        first.followed_by(output("other", [1], "x"))


async def test_outputs_queued_behind_an_unread_one_go_out_as_one():
    s = stream("r")
    assert not s._put(0, output("r", [1], "a"))
    assert not s._put(0, output("r", [2], "ab"))
    assert s._put(0, output("r", [3], "abc", done=True))  # the final one: reported as such
    assert s.finished
    ((index, joined),) = await read(s)
    assert index == 0 and joined.new_token_ids == [1, 2, 3] and joined.new_text == "abc"
    assert joined.finished and joined.finish_reason == "length"


async def test_an_output_read_before_the_next_arrives_stays_its_own_chunk():
    s = stream("r")
    s._put(0, output("r", [1], "a"))
    iterator = s.__aiter__()
    index, first = await iterator.__anext__()
    assert first.new_token_ids == [1]
    s._put(0, output("r", [2], "ab", done=True))
    index, second = await iterator.__anext__()
    assert second.new_token_ids == [2] and second.finished


async def test_other_requests_and_errors_are_never_merged():
    s = stream("r0", "r1")
    s._put(0, output("r0", [1], "a"))
    s._put(1, output("r1", [5], "x"))
    s._put(0, output("r0", [2], "ab", done=True))  # behind r1's output: not adjacent, kept apart
    s._put(1, EngineLoopError("the engine failed"))
    pairs = []
    with pytest.raises(EngineLoopError, match="the engine failed"):
        async for pair in s:
            pairs.append(pair)
    assert [(i, o.new_token_ids) for i, o in pairs] == [(0, [1]), (1, [5]), (0, [2])]


async def test_an_error_after_unread_output_is_raised_after_it():
    s = stream("r")
    s._put(0, output("r", [1], "a"))
    s._put(0, EngineLoopError("the server stopped"))
    iterator = s.__aiter__()
    index, first = await iterator.__anext__()
    assert first.new_token_ids == [1]
    with pytest.raises(EngineLoopError):
        await iterator.__anext__()

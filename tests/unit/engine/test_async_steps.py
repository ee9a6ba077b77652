"""Steps overlap with the GPU: step N+1 is scheduled before step N's tokens are known, its decodes
read them on the device, and outputs come one step later. What a user sees must not change: the
same tokens as one request alone, stops on a stop token or a stop string exactly where they fall
(the extra token of the step already in flight is dropped), no placeholder ever delivered, and no
KV block left behind, under preemption and aborts."""

from __future__ import annotations

import random

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.sequence import PLACEHOLDER


def _engine(model_dir, **options) -> LLMEngine:
    defaults = dict(device="cpu", max_model_len=128, block_size=4, max_num_seqs=6, max_num_batched_tokens=64)
    defaults.update(options)
    return LLMEngine(EngineArgs(model=str(model_dir), **defaults))


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]], abort_at=None):
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {r: [] for r in requests}
    final: dict[str, tuple[list[int], str | None]] = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert PLACEHOLDER not in out.new_token_ids, "a token of a step in flight was delivered"
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                assert out.token_ids == tokens[out.request_id]
                final[out.request_id] = (out.token_ids, out.finish_reason)
        steps += 1
        if abort_at and steps in abort_at:
            engine.abort(abort_at[steps])
    assert engine.stats().kv_blocks_used == 0
    return final


def test_stops_and_preemption_give_what_each_request_gets_alone(tiny_model_dir):
    rng = random.Random(3)
    prompts = [[rng.randrange(100, 30000) for _ in range(rng.randrange(3, 60))] for _ in range(10)]
    free_run = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = {}
    solo = _engine(tiny_model_dir)
    for i, prompt in enumerate(prompts):  # each alone, no stops: the reference token streams
        alone[i] = _run(solo, {f"solo-{i}": (prompt, free_run)})[f"solo-{i}"][0]
    requests = {}
    for i, prompt in enumerate(prompts):
        # Every third request stops on the token it produces 5th (a commit-time stop while the next
        # step is already on the GPU); the others run to max_tokens.
        stop = [alone[i][4]] if i % 3 == 0 else None
        requests[str(i)] = (prompt, SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=stop))
    # 40 blocks of 4 tokens for 6 running sequences of up to ~84 tokens: preemption is certain.
    engine = _engine(tiny_model_dir, num_kv_blocks=40)
    final = _run(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for i in range(len(prompts)):
        token_ids, reason = final[str(i)]
        if i % 3 == 0:
            cut = alone[i].index(alone[i][4]) + 1
            assert (token_ids, reason) == (alone[i][:cut], "stop")
        else:
            assert (token_ids, reason) == (alone[i], "length")


def test_a_stop_string_drops_the_token_already_in_flight(tiny_model_dir):
    prompt = [1000 + i for i in range(20)]
    reference = _engine(tiny_model_dir)
    full = _run(reference, {"r": (prompt, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))})
    text = reference.tokenizer.decode(full["r"][0])
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop])
    token_ids, reason = _run(reference, {"s": (prompt, params)})["s"]
    assert reason == "stop"
    assert token_ids == full["r"][0][: len(token_ids)] and len(token_ids) < 16


def test_aborts_between_steps_leave_nothing_behind(tiny_model_dir):
    rng = random.Random(5)
    requests = {
        str(i): (
            [rng.randrange(100, 30000) for _ in range(rng.randrange(3, 40))],
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        )
        for i in range(8)
    }
    engine = _engine(tiny_model_dir, num_kv_blocks=48)
    final = _run(engine, requests, abort_at={2: "0", 5: "3", 9: "5"})
    # 20 tokens take more than 9 steps: the aborted requests never finish; every other one does, whole.
    assert set(final) == set(requests) - {"0", "3", "5"}
    assert all(final[r] == (final[r][0], "length") and len(final[r][0]) == 20 for r in final)

"""The step-level engine the server drives: incremental outputs, abort, sizing, introspection."""

from __future__ import annotations

import pytest

from engine import EngineArgs, EngineStats, LLMEngine, SamplingParams


@pytest.fixture()
def engine(tiny_model_dir):
    return LLMEngine(
        EngineArgs(
            model=str(tiny_model_dir),
            device="cpu",
            num_kv_blocks=32,
            block_size=16,
            max_model_len=256,
            max_num_batched_tokens=64,
            max_num_seqs=8,
        )
    )


def run_to_end(engine: LLMEngine) -> dict[str, list]:
    seen: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(out)
    return seen


def test_incremental_outputs_add_up_to_the_final_one(engine):
    engine.add_request(
        "a", [1000 + i for i in range(100)], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    engine.add_request("b", "some text", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    seen = run_to_end(engine)
    for outputs in seen.values():
        final = outputs[-1]
        assert final.finished and all(not o.finished for o in outputs[:-1])
        assert sum((o.new_token_ids for o in outputs), []) == final.token_ids
        assert "".join(o.new_text for o in outputs) == final.text
        assert final.finish_reason == "length"
    assert len(seen["a"][-1].token_ids) == 12
    assert seen["b"][-1].prompt_token_ids == engine.tokenizer.encode("some text", add_special_tokens=False)


def test_streamed_text_never_shows_part_of_a_stop_string(engine):
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    engine.add_request("ref", [1000, 2000, 3000], params)
    full = run_to_end(engine)["ref"][-1].text
    stop = full[10:16]
    engine.add_request(
        "s", [1000, 2000, 3000], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=stop)
    )
    outputs = run_to_end(engine)["s"]
    streamed = ""
    for out in outputs:
        streamed += out.new_text
        assert stop not in streamed
    assert streamed == full[: full.find(stop)]


def test_abort_frees_blocks_at_once(engine):
    engine.add_request("a", [1000] * 50, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [1001] * 50, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.stats().kv_blocks_used > 0
    assert engine.abort("a")
    assert not engine.abort("a")
    assert engine.stats().num_running == 1
    assert engine.abort("b")
    # Nothing is used; each prompt's three full blocks (16 of its 50 tokens each) stay cached.
    assert engine.stats() == EngineStats(
        num_running=0,
        num_waiting=0,
        kv_blocks_used=0,
        kv_blocks_total=32,
        kv_blocks_cached=6,
        prefix_cache_queries=100,
        prefix_cache_hits=0,
    )
    assert engine.step() == []
    engine.allocator.check_integrity()


def test_duplicate_request_id_is_refused(engine):
    engine.add_request("x", [1000], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("x", [1000], SamplingParams(max_tokens=2))


def test_kv_cache_sized_from_memory(tiny_model_dir):
    engine = LLMEngine(
        EngineArgs(model=str(tiny_model_dir), device="cpu", kv_cache_memory=8 << 20, max_model_len=512)
    )
    per_block = 2 * 4 * 2 * 32 * 4 * 16  # K and V, 4 layers, 2 KV heads of 32, float32, 16 tokens
    assert engine.cache_config.num_blocks == (8 << 20) // per_block
    config = engine.config_dict()
    assert config["num_kv_blocks"] == engine.cache_config.num_blocks
    assert config["dtype"] == "float32" and config["device"] == "cpu"
    assert set(EngineArgs.field_names()) <= set(config)


def test_sequence_cap_defaults_to_1024_and_to_a_smaller_token_budget(tiny_model_dir):
    def in_force(**options) -> dict:
        args = EngineArgs(
            model=str(tiny_model_dir), device="cpu", num_kv_blocks=32, max_model_len=256, **options
        )
        engine = LLMEngine(args)
        assert engine.scheduler.config.max_num_seqs == engine.max_num_seqs
        return engine.config_dict()

    assert in_force()["max_num_seqs"] == 1024  # with the default token budget of 8,192
    # a token budget under 1,024 caps it, so every running sequence still decodes in one step
    assert in_force(max_num_batched_tokens=64)["max_num_seqs"] == 64
    assert in_force(max_num_batched_tokens=64, max_num_seqs=8)["max_num_seqs"] == 8
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(64\) must be >= max_num_seqs \(65\)"):
        in_force(max_num_batched_tokens=64, max_num_seqs=65)
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1, got 0"):
        in_force(max_num_seqs=0)

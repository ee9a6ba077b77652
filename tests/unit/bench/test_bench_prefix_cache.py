"""Workloads that share prompt prefixes (shared-prefix, multi-turn), and the client's view of a server's
prefix cache (bench.prefix): its counters, its reset, levels from an empty cache with prompts of their
own; against this project's server with the tiny model and its cache on, as the perf tier starts it."""

from __future__ import annotations

import math

import pytest

from bench.client import Endpoint
from bench.launch import CACHE_OFF_FLAG, VLLM_RESET_ENV, ServerProcess, ServerSpec, target_args
from bench.prefix import (
    CacheCounters,
    hit_figures,
    level_seed,
    parse_counters,
    read_counters,
    reset_prefix_cache,
    run_fresh_level,
)
from bench.profiles import PROFILES, PrefixShape, prefix_workload
from bench.runner import LoadConfig
from bench.trials import summary_name
from bench.workload import WorkloadSpec, conversation_turn, make_request

SERVER_START_DEADLINE_S = 120.0  # a deadline against a server that never gets ready, not a speed


def shared(**kwargs) -> WorkloadSpec:
    return WorkloadSpec(
        kind="shared-prefix", **{"num_prefixes": 3, "prefix_len": 40, "suffix_len": 8, **kwargs}
    )


def turns(**kwargs) -> WorkloadSpec:
    fields = {"prefix_len": 30, "suffix_len": 5, "output_len": 7, "turns": 3, "conversations": 2, **kwargs}
    return WorkloadSpec(kind="multi-turn", **fields)


def test_shared_prefix_requests_share_one_of_k_prefixes_then_differ():
    spec = shared()
    requests = [make_request(spec, i) for i in range(9)]
    assert all(r.prompt_len == 48 == len(r.prompt) and r.max_tokens == spec.output_len for r in requests)
    prefixes = [tuple(r.prompt[:40]) for r in requests]
    assert len(set(prefixes)) == 3
    assert prefixes[0] == prefixes[3] == prefixes[6] and prefixes[0] != prefixes[1]  # i mod K
    assert len({tuple(r.prompt[40:]) for r in requests}) == 9  # each suffix its own
    assert [r.prompt for r in requests] == [make_request(spec, i).prompt for i in range(9)]
    other = [make_request(shared(seed=1), i).prompt[:40] for i in range(3)]
    assert not set(map(tuple, other)) & set(prefixes)  # another seed: other prefixes


def test_a_turn_resends_the_turn_before_it_its_recorded_reply_and_a_new_message():
    spec = turns()
    assert [conversation_turn(spec, i) for i in range(8)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2), (2, 0), (3, 0)
    ]  # fmt: skip
    by_turn = {conversation_turn(spec, i): make_request(spec, i) for i in range(12)}
    for conversation in range(4):
        for turn in (1, 2):
            before, now = by_turn[conversation, turn - 1], by_turn[conversation, turn]
            assert now.prompt[: len(before.prompt)] == before.prompt
            assert now.prompt_len == len(now.prompt) == len(before.prompt) + 7 + 5
            assert now.max_tokens == 7  # the budget is a recorded reply's length
    assert by_turn[0, 0].prompt != by_turn[1, 0].prompt
    # the replies are part of the workload: the same for every server and run
    assert make_request(spec, 4).prompt == make_request(turns(), 4).prompt


def test_prefix_workloads_send_token_ids_and_need_positive_sizes():
    with pytest.raises(ValueError, match="token ids"):
        shared(prompt_format="text", tokenizer="/m")
    with pytest.raises(ValueError, match="conversations"):
        turns(conversations=0)


PROMETHEUS = """# HELP engine_prefix_cache_queries_total Tokens looked up.
# TYPE engine_prefix_cache_queries_total counter
engine_prefix_cache_queries_total 1200.0
engine_prefix_cache_hits_total 300.0
engine_prefix_cache_hits_created 1.7e9
"""
VLLM = """vllm:prefix_cache_queries_total{engine="0",model_name="m"} 100.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 50.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 30.0
vllm:num_requests_running{engine="0",model_name="m"} 2.0
"""


def test_both_servers_counters_are_read_and_turned_into_a_hit_rate():
    assert parse_counters(PROMETHEUS) == CacheCounters(1200.0, 300.0)
    assert parse_counters(VLLM) == CacheCounters(150.0, 30.0)  # summed over label sets
    assert parse_counters("http_requests_total 4\n") is None
    figures = hit_figures(CacheCounters(100.0, 10.0), CacheCounters(300.0, 110.0))
    assert figures == {
        "prefix_cache_queries": 200.0,
        "prefix_cache_hits": 100.0,
        "prefix_cache_hit_rate": 0.5,
    }
    assert hit_figures(None, CacheCounters(1.0, 1.0)) == {}
    assert math.isnan(hit_figures(CacheCounters(5.0, 1.0), CacheCounters(5.0, 1.0))["prefix_cache_hit_rate"])


def test_a_cache_on_server_drops_only_the_cache_off_flag_and_seeds_move_past_every_level():
    for target in ("engine", "vllm"):
        args = target_args(target, "float32")
        assert CACHE_OFF_FLAG in args and ServerSpec.for_target(target, "m", "float32").env == {}
        kept = target_args(target, "float32", prefix_cache=True)
        assert kept == [arg for arg in args if arg != CACHE_OFF_FLAG] and len(kept) == len(args) - 1
        spec = ServerSpec.for_target(target, "m", "float32", prefix_cache=True)
        assert spec.args == kept
        # vLLM serves POST /reset_prefix_cache only with its development endpoints on; ours always does
        assert spec.env == (VLLM_RESET_ENV if target == "vllm" else {})
    seeds = {level_seed(0, level) for level in range(50)}
    assert len(seeds) == 50 and not seeds & {0, 1}  # neither the workload's nor the warm-up's


def test_profiles_run_the_prefix_modes_against_their_own_files():
    full = PROFILES["full"]
    assert full.prefix_modes == ("shared-prefix", "multi-turn", "cache-on")
    assert full.for_mode("shared-prefix").concurrencies == (8, 64) and full.for_mode("cache-on").sweep is None
    assert PROFILES["smoke"].prefix_modes == ()  # CI's time
    assert summary_name("vllm", "shared-prefix") == "vllm-shared-prefix.json"
    assert summary_name("engine", "multi-turn") == "engine-multi-turn.json"
    assert summary_name("engine", "cache-on") == "engine-seed-mix-cache-on.json"
    workload = prefix_workload("multi-turn", PrefixShape(), 64)
    assert workload.conversations == 128 and workload.kind == "multi-turn"
    longest = workload.prefix_len + (workload.turns - 1) * (workload.output_len + workload.suffix_len)
    assert longest + workload.output_len <= 4352  # bench.launch.MAX_MODEL_LEN
    assert prefix_workload("cache-on", PrefixShape(), 8).kind == "seed-mix"


@pytest.fixture(scope="module")
def cached_tiny_server(tiny_model_dir, tmp_path_factory):
    """This project's server with the tiny model on CPU and its prefix cache on."""
    spec = ServerSpec.for_target("engine", str(tiny_model_dir), "float32", prefix_cache=True)
    with ServerProcess(spec, tmp_path_factory.mktemp("logs") / "server.log") as process:
        process.start(timeout_s=SERVER_START_DEADLINE_S)
        yield Endpoint(spec.base_url, model=str(tiny_model_dir), target="engine")


def test_shared_prefixes_hit_the_cache_and_a_fresh_level_starts_empty(cached_tiny_server):
    endpoint = cached_tiny_server
    assert reset_prefix_cache(endpoint) == ""
    assert read_counters(endpoint) is not None
    # 2 prefixes of 4 blocks (16 tokens a block), 8 requests one after another: 6 find theirs cached
    workload = WorkloadSpec(kind="shared-prefix", num_prefixes=2, prefix_len=64, suffix_len=16, output_len=4)
    load = LoadConfig(n_requests=8, progress=False)
    first = run_fresh_level(endpoint, workload, 1, load, level=0)
    assert first.summary["failures"] == 0 and first.summary["prefix_cache_reset"] is True
    assert first.summary["seed"] == level_seed(0, 0)
    assert first.summary["prefix_cache_queries"] == 8 * 80
    assert first.summary["prefix_cache_hits"] >= 6 * 64  # each prefix computed once
    # The same level again: reset and a fresh seed, so its prefixes miss once each again.
    again = run_fresh_level(endpoint, workload, 1, load, level=0)
    assert again.summary["prefix_cache_hits"] == first.summary["prefix_cache_hits"]
    # The seed-mix shares nothing: from an empty cache its random prompts hit (nearly) never.
    mix = run_fresh_level(endpoint, WorkloadSpec(kind="fixed", input_len=64, output_len=4), 1, load, level=1)
    assert mix.summary["prefix_cache_hit_rate"] < 0.1 < first.summary["prefix_cache_hit_rate"]
    # The reset was honoured. The client's timing notes (event-loop lag, send lag) on a loaded 2-core
    # machine are about timestamps, not about the cache: only the reset's own warning counts here.
    assert mix.summary["prefix_cache_reset"] is True
    assert not [w for w in mix.warnings if "not reset" in w], mix.warnings


def test_a_multi_turn_replay_hits_its_earlier_turns(cached_tiny_server):
    workload = turns(prefix_len=48, suffix_len=16, output_len=16, conversations=2)
    level = run_fresh_level(
        cached_tiny_server, workload, 1, LoadConfig(n_requests=6, progress=False), level=2
    )
    assert level.summary["failures"] == 0
    # turns 1 and 2 of both conversations find the turn before them cached: its 48 + ... tokens' full blocks
    assert level.summary["prefix_cache_hits"] >= 2 * (48 + 80)


# -- in the perf tier ------------------------------------------------------------------------------
def test_the_tier_runs_each_targets_prefix_cases_last_against_their_own_server():
    from perf_tier_process import run_perf_tier

    done = run_perf_tier(["--collect-only", "--profile", "short", "--target", "both"], timeout_s=60)
    assert done.returncode == 0, done.stdout[-2000:]
    names = [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line]
    for target in ("vllm", "engine"):
        mine = [name for name in names if name.endswith(f"-{target}]")]
        cached = [name for name in mine if name.startswith("test_prefix_cache")]
        assert cached == [
            f"test_prefix_cache[shared-prefix-64-{target}]",
            f"test_prefix_cache[multi-turn-64-{target}]",
            f"test_prefix_cache[cache-on-64-{target}]",
        ]
        assert mine[-3:] == cached and mine[0].startswith("test_offline")
    assert names.index("test_prefix_cache[cache-on-64-vllm]") < names.index("test_offline[greedy-engine]")


def test_the_tier_measures_a_shared_prefix_case_and_names_what_it_lacks(tmp_path):
    """Against the fake server (no /reset_prefix_cache, no counters): recorded in its own file, the
    missing reset and counters said in the notes, the budgets skipped for want of a reference."""
    import json

    from perf_tier_process import run_perf_tier

    from bench.fake_server import FakeServerConfig, FakeServerThread

    with FakeServerThread(FakeServerConfig(ttft_s=0.005, itl_s=0.0005)) as fake:
        args = ["-rs", "--server-url", fake.base_url, "--profile", "short", "--trials", "1"]
        args += ["--model", "prefix-test-model", "--perf-out", str(tmp_path), "-k", "shared-prefix"]
        run = run_perf_tier(args, timeout_s=120)
    assert run.returncode == 0, run.stdout[-2000:]
    summary = json.loads((tmp_path / "engine-shared-prefix.json").read_text())
    assert (summary["mode"], summary["workload"], summary["prefix_cache"]) == (
        "shared-prefix",
        "shared-prefix",
        True,
    )
    assert [level["concurrency"] for level in summary["closed_loop"]] == [64.0]
    text = " ".join(run.stdout.split())
    assert "engine, shared-prefix (prefix cache on): capacity" in text
    assert "POST /reset_prefix_cache answered 404" in text
    assert "exposes no prefix cache counters" in text
    assert "(shared-prefix: looked for baselines/cpu/prefix-test-model/vllm-shared-prefix.json" in text


def test_bench_run_measures_fresh_levels_and_their_hit_rates(cached_tiny_server, tmp_path):
    import json

    from bench.__main__ import main

    out = tmp_path / "run"
    argv = ["run", "--base-url", cached_tiny_server.base_url, "--workload", "shared-prefix"]
    argv += ["--num-prefixes", "1", "--prefix-len", "32", "--suffix-len", "8", "--output-len", "2"]
    argv += [
        "--concurrency",
        "1,1",
        "--n-requests",
        "3",
        "--fresh-prefix-cache",
        "--quiet",
        "--out",
        str(out),
    ]
    assert main(argv) == 0
    levels = json.loads((out / "run.json").read_text())["levels"]
    assert [level["seed"] for level in levels] == [level_seed(0, 0), level_seed(0, 1)]
    for level in levels:  # from an empty cache: the first request computes the prefix, two find it
        assert level["prefix_cache_reset"] is True
        assert level["prefix_cache_hits"] == 2 * 32 and level["prefix_cache_queries"] == 3 * 40


def test_bench_offline_sends_a_shared_prefix_workload_to_the_engine_with_its_cache_on(
    tiny_model_dir, tmp_path
):
    """`bench offline --workload shared-prefix --option enable_prefix_caching=true`, one request at a
    time: the engine's own counters (in run.json's worker description, since its start) find each
    prefix computed once and shared after. (Requests added at once and admitted in one step share
    nothing: no block of theirs is computed when they are looked up.)"""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "offline"
    args = [
        "--target",
        "engine",
        "--model",
        str(tiny_model_dir),
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
    ]
    args += ["--workload", "shared-prefix", "--num-prefixes", "2", "--prefix-len", "64", "--suffix-len", "16"]
    args += ["--output-len", "4", "--n-requests", "0", "--concurrency", "1", "--duration", "3"]
    args += ["--warmup", "0", "--single-tokens", "0"]
    args += ["--prefill-prompts", "0", "--option", "enable_prefix_caching=true", "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "bench", "offline", *args],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[3],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["workload"]["kind"] == "shared-prefix"
    cache = run["worker"]["target"]["prefix_cache"]
    sent, left = divmod(cache["queries"], 80)
    assert left == 0 and sent >= run["offline"]["closed-1"]["completed"] >= 3
    assert (sent - 2) * 64 <= cache["hits"] <= sent * 64  # each prefix computed once, then found
    # the closed loop's own entry holds the same counts (no warm-up ran), as the HTTP levels name them
    entry = run["offline"]["closed-1"]
    assert (entry["prefix_cache_queries"], entry["prefix_cache_hits"]) == (cache["queries"], cache["hits"])
    assert entry["prefix_cache_hit_rate"] == pytest.approx(cache["hits"] / cache["queries"])
    assert f"prefix cache hit rate {entry['prefix_cache_hit_rate']:.3f}" in done.stdout


def test_a_chat_replay_extends_the_conversation_a_turn_at_a_time(tiny_model_dir):
    from bench.client import request_body
    from bench.prompts import load_tokenizer

    spec = turns(api="chat", tokenizer=str(tiny_model_dir))
    by_turn = {conversation_turn(spec, i): make_request(spec, i) for i in range(6)}
    for conversation in (0, 1):
        first, second, third = (by_turn[conversation, t] for t in range(3))
        assert [role for role, _ in third.messages] == ["user", "assistant", "user", "assistant", "user"]
        assert second.messages[:1] == first.messages and third.messages[:3] == second.messages
        assert first.prompt_len < second.prompt_len < third.prompt_len
    tokenizer = load_tokenizer(str(tiny_model_dir))
    request = by_turn[1, 2]
    messages = [{"role": role, "content": text} for role, text in request.messages]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert request.prompt_len == len(tokenizer.encode(rendered, add_special_tokens=False))
    assert request_body("m", request)["messages"] == messages
    assert [len(tokenizer.encode(t, add_special_tokens=False)) for _, t in request.messages] == [
        30,
        7,
        5,
        7,
        5,
    ]
    with pytest.raises(ValueError, match="token ids"):
        shared(api="chat", tokenizer=str(tiny_model_dir))


def test_a_chat_replay_hits_its_earlier_turns_and_is_counted_at_its_length(
    cached_tiny_server, tiny_model_dir
):
    workload = turns(prefix_len=48, suffix_len=16, output_len=16, api="chat", tokenizer=str(tiny_model_dir))
    level = run_fresh_level(
        cached_tiny_server, workload, 1, LoadConfig(n_requests=6, progress=False), level=3
    )
    assert level.summary["failures"] == 0
    assert level.summary["prompt_tokens_mismatched"] == 0
    # each later turn finds at least the blocks of the first message cached
    assert level.summary["prefix_cache_hits"] >= 4 * 48

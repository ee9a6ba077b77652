"""bench.server_metrics: a server's /metrics read around a level, and the parts of its time to first
token recorded with the level (`bench run`'s run.json), from this project's server and vLLM's page."""

from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.launch import ServerProcess, ServerSpec
from bench.server_metrics import (
    FIRST_TOKEN_KEYS,
    KERNEL_COMPILES_KEY,
    describe_first_token,
    describe_kernel_compiles,
    first_token_figures,
    kernel_compile_figures,
    metric_totals,
)
from bench.trials import summarize_trials

SERVER_START_DEADLINE_S = 120.0  # a deadline against a server that never gets ready, not a speed

OURS = """\
# HELP engine_time_to_first_token_seconds Arrival to first generated token.
# TYPE engine_time_to_first_token_seconds histogram
engine_time_to_first_token_seconds_bucket{le="0.1"} 3.0
engine_time_to_first_token_seconds_count 4.0
engine_time_to_first_token_seconds_sum 0.4
server_request_to_core_seconds_count 4.0
server_request_to_core_seconds_sum 0.004
engine_request_queue_time_seconds_count 4.0
engine_request_queue_time_seconds_sum 0.1
engine_request_prefill_time_seconds_count 4.0
engine_request_prefill_time_seconds_sum 0.28
server_first_token_delivery_seconds_count 4.0
server_first_token_delivery_seconds_sum 0.016
"""
VLLM = """\
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 6.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.9
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 4.0
vllm:time_to_first_token_seconds_sum{engine="1",model_name="m"} 0.6
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 10.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.7
"""


def test_totals_sum_each_name_over_its_label_sets_and_skip_what_is_not_a_sample() -> None:
    totals = metric_totals(VLLM + "# a comment\n\nnot_a_number x\n")
    assert totals["vllm:time_to_first_token_seconds_count"] == 10.0
    assert totals["vllm:time_to_first_token_seconds_sum"] == pytest.approx(1.5)
    assert "not_a_number" not in totals


def test_first_token_parts_are_means_over_the_requests_between_two_reads() -> None:
    before = metric_totals(OURS)
    after = {name: value * 3 for name, value in before.items()}  # 8 more first tokens, sums x3
    figures = first_token_figures(before, after)
    assert set(figures) == set(FIRST_TOKEN_KEYS)
    assert figures["server_ttft_mean_s"] == pytest.approx(0.8 / 8)
    assert figures["server_queue_mean_s"] == pytest.approx(0.2 / 8)
    assert figures["server_prefill_mean_s"] == pytest.approx(0.56 / 8)
    # vLLM has no hops to report: those parts are left out, not zero
    vllm = first_token_figures({}, metric_totals(VLLM))
    assert vllm == pytest.approx(
        {"server_ttft_mean_s": 0.15, "server_queue_mean_s": 0.05, "server_prefill_mean_s": 0.07}
    )
    # no first token in between, a server without the histograms, or no page: nothing
    assert first_token_figures(before, before) == {}
    assert first_token_figures({}, {"http_requests_total": 3.0}) == {}
    assert first_token_figures(None, after) == first_token_figures(before, None) == {}


def test_the_terminal_line_names_the_parts_a_server_has() -> None:
    ours = first_token_figures({}, metric_totals(OURS))
    assert describe_first_token(ours) == (
        ", server TTFT mean 100.0 ms (to core 1.0, queued 25.0, prefill 70.0, delivery 4.0)"
    )
    vllm = first_token_figures({}, metric_totals(VLLM))
    assert describe_first_token(vllm) == ", server TTFT mean 150.0 ms (queued 50.0, prefill 70.0)"
    assert describe_first_token({"output_tok_s": 5.0}) == ""


def test_a_levels_kernel_compiles_are_the_counters_growth_and_shown_where_any() -> None:
    before = metric_totals(OURS + "engine_kernel_compiles_total 2.0\n")
    after = metric_totals(OURS + "engine_kernel_compiles_total 5.0\n")
    assert kernel_compile_figures(before, after) == {KERNEL_COMPILES_KEY: 3.0}
    assert kernel_compile_figures({}, before) == {KERNEL_COMPILES_KEY: 2.0}
    # vLLM has no such counter, and no page is no figure
    assert kernel_compile_figures({}, metric_totals(VLLM)) == {}
    assert kernel_compile_figures(None, after) == kernel_compile_figures(before, None) == {}
    level = first_token_figures({}, metric_totals(OURS)) | {KERNEL_COMPILES_KEY: 3.0}
    assert describe_kernel_compiles(level) == ", 3 kernel compiles while serving"
    assert describe_kernel_compiles(level | {KERNEL_COMPILES_KEY: 0.0}) == ""
    assert describe_kernel_compiles({"output_tok_s": 5.0}) == ""
    assert "compiles" not in describe_first_token(level)


def test_a_summary_folds_the_parts_where_its_levels_have_them() -> None:
    level = {"concurrency": 4.0, "output_tok_s": 10.0, "ttft_p50_s": 0.1, "itl_p50_s": 0.01}
    level |= {"tpot_p50_s": 0.01, "failures": 0.0}
    trials = [[{**level, "server_queue_mean_s": q}] for q in (0.01, 0.03, 0.02)]
    summary = summarize_trials(header={}, sweep_trials=[], closed_trials=trials, trials=3)
    (folded,) = summary["closed_loop"]
    assert folded["server_queue_mean_s"] == 0.02 and folded["server_queue_mean_s_trials"] == [
        0.01,
        0.03,
        0.02,
    ]
    assert "server_prefill_mean_s" not in folded  # no level had it
    bare = summarize_trials(header={}, sweep_trials=[], closed_trials=[[level]], trials=1)
    assert not set(FIRST_TOKEN_KEYS) & set(bare["closed_loop"][0])


def test_bench_run_records_the_servers_split_of_the_time_to_first_token(tiny_model_dir, tmp_path) -> None:
    spec = ServerSpec.for_target("engine", str(tiny_model_dir), "float32")
    out = tmp_path / "run"
    with ServerProcess(spec, tmp_path / "server.log") as process:
        process.start(timeout_s=SERVER_START_DEADLINE_S)
        argv = ["run", "--base-url", spec.base_url, "--workload", "fixed", "--input-len", "64"]
        argv += [
            "--output-len",
            "4",
            "--concurrency",
            "1,3",
            "--n-requests",
            "6",
            "--quiet",
            "--out",
            str(out),
        ]
        assert main(argv) == 0
    levels = json.loads((out / "run.json").read_text())["levels"]
    assert len(levels) == 2
    for level in levels:
        assert level["failures"] == 0
        parts = [level[key] for key in FIRST_TOKEN_KEYS[1:]]
        assert all(part >= 0 for part in parts), parts
        # the four parts add up to the server's TTFT request by request, so their means do too
        assert sum(parts) == pytest.approx(level["server_ttft_mean_s"], abs=1e-6)
        assert level[KERNEL_COMPILES_KEY] == 0  # on CPU nothing compiles

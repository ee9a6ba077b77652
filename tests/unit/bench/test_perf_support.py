"""The perf tier's support code: trial folding, budgets, the machine slug, server launching."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from bench.budgets import BudgetCheck, check_closed, check_sweep, load_budgets
from bench.launch import ServerProcess, ServerSpec, engine_args, free_port, vllm_args
from bench.machine import gpu_slug, same_machine
from bench.results import load_result
from bench.trials import merge_summaries, summarize_trials

BUDGETS_FILE = Path(__file__).resolve().parents[2] / "perf" / "budgets.toml"


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_slug("  A100-SXM4 (40GB) ") == "a100-sxm4-40gb"
    assert gpu_slug(None) == "cpu"


def test_same_machine_needs_every_field_equal():
    a = {"gpu": "NVIDIA H200", "cpu_model": "EPYC", "cpu_count": 16, "hostname": "h1"}
    assert same_machine(a, dict(a))
    assert not same_machine(a, dict(a, hostname="h2"))
    assert not same_machine(a, None)


def test_trials_fold_to_median_min_max_and_match_levels():
    sweeps = [
        {
            "capacity_req_s": c,
            "capacity_still_rising": False,
            "levels": [{"rate": 2.0, "served_req_s": s, "ttft_p50_s": 0.1, "failures": 0}],
        }
        for c, s in ((10.0, 1.9), (12.0, 2.0), (11.0, 2.1))
    ]
    sweeps[2]["levels"].append(
        {"rate": 3.0, "served_req_s": 2.9, "ttft_p50_s": 0.2, "failures": 0}
    )  # bisection found a rate only once
    closed = [[{"concurrency": 8, "output_tok_s": v, "failures": 0}] for v in (100.0, 90.0, 110.0)]
    summary = summarize_trials(
        header={"target": "engine"}, sweep_trials=sweeps, closed_trials=closed, trials=3
    )
    assert (summary["capacity_req_s"], summary["capacity_req_s_min"], summary["capacity_req_s_max"]) == (
        11.0,
        10.0,
        12.0,
    )
    rate2, rate3 = summary["open_loop"]
    assert rate2["rate"] == 2.0 and rate2["trials"] == 3 and rate2["served_req_s"] == 2.0
    assert rate3["trials"] == 1 and rate3["served_req_s_min"] == rate3["served_req_s_max"] == 2.9
    assert math.isnan(rate2["e2e_p50_s"])  # absent in every trial
    level = summary["closed_loop"][0]
    assert (level["output_tok_s"], level["output_tok_s_min"], level["output_tok_s_max"]) == (
        100.0,
        90.0,
        110.0,
    )
    assert summary["trials"] == 3 and summary["target"] == "engine"


def test_the_reviewed_budget_file_loads():
    budgets = load_budgets(BUDGETS_FILE)
    assert {"vllm", "engine"} <= set(budgets)
    for section in budgets.values():
        for budget in section.values():
            assert not budget.lenient or budget.reason


def test_lenient_budget_without_reason_is_refused(tmp_path):
    path = tmp_path / "budgets.toml"
    path.write_text("[vllm]\ncapacity_req_s = 0.3\n")
    with pytest.raises(ValueError, match="reason"):
        load_budgets(path)
    path.write_text("[vllm]\ncapacity_req_s = { budget = 0.3, reason = 'not tuned yet' }\nttft_p50_s = 1.5\n")
    assert load_budgets(path)["vllm"]["ttft_p50_s"].value == 1.5
    path.write_text("[vllm]\nitl_p50_s = 1.5\n")
    with pytest.raises(ValueError, match="not a budgeted metric"):
        load_budgets(path)


def test_budget_checks_read_directions_and_saturation():
    budgets = {"capacity_req_s": 0.5, "ttft_p50_s": 2.0, "tpot_p50_s": 2.0, "output_tok_s": 0.5}
    budgets = {k: type("B", (), {"value": v})() for k, v in budgets.items()}
    reference = {
        "capacity_req_s": 10.0,
        "open_loop": [
            {"rate": 2.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01},
            {"rate": 4.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01},
        ],
        "closed_loop": [{"concurrency": 8, "output_tok_s": 1000.0}],
    }
    ours = [
        {"rate": 2.0, "ttft_p50_s": 0.15, "tpot_p50_s": 0.03},
        {"rate": 4.0, "ttft_p50_s": 9.0, "tpot_p50_s": 9.0},
    ]
    checks = check_sweep(4.5, ours, reference, budgets)
    by_name = {(c.level, c.metric): c for c in checks}
    assert not by_name[("sweep", "capacity_req_s")].passed  # 4.5 < 0.5 x 10
    assert by_name[("rate 2/s", "ttft_p50_s")].passed  # 0.15 <= 2 x 0.1
    assert not by_name[("rate 2/s", "tpot_p50_s")].passed  # 0.03 > 2 x 0.01
    assert ("rate 4/s", "ttft_p50_s") not in by_name  # 4 >= 0.8 x 4.5: saturated, not budgeted
    closed = check_closed(8, {"output_tok_s": 600.0}, reference, budgets)
    assert [c.passed for c in closed] == [True]
    assert check_closed(32, {"output_tok_s": 1.0}, reference, budgets) == []


def test_budget_check_capacity_boundary():
    assert BudgetCheck("sweep", "capacity_req_s", 5.0, 10.0, 0.5).passed
    assert not BudgetCheck("sweep", "capacity_req_s", 4.99, 10.0, 0.5).passed
    assert BudgetCheck("rate 1/s", "ttft_p50_s", 0.2, 0.1, 2.0).passed
    assert not BudgetCheck("rate 1/s", "ttft_p50_s", 0.21, 0.1, 2.0).passed
    assert not BudgetCheck("sweep", "capacity_req_s", math.nan, 10.0, 0.5).passed
    assert "FAILS" in BudgetCheck("sweep", "capacity_req_s", 1.0, 10.0, 0.5).describe()


def test_server_commands_follow_the_baseline_definition():
    engine = ServerSpec("engine", "/m", 8000, engine_args("bfloat16", 4352))
    assert engine.command()[1:3] == ["-m", "server"]
    assert engine.command()[-6:] == ["--dtype", "bfloat16", "--max-model-len", "4352", "--seed", "0"]
    vllm = ServerSpec("vllm", "/m", 8001, vllm_args("bfloat16", 4352), env_file="/site/env.sh")
    command = vllm.command()
    assert command[:4] == ["bash", "-c", 'source "$0" && exec "$@"', "/site/env.sh"]
    assert "--no-enable-prefix-caching" in command and "serve" in command
    with pytest.raises(ValueError):
        ServerSpec("sglang", "/m", 1).command()


def test_server_process_starts_waits_for_health_and_stops(tmp_path, monkeypatch):
    spec = ServerSpec("engine", "unused", free_port())
    # Stand in for `python -m server` with the fake OpenAI server, which answers /health too.
    monkeypatch.setattr(
        ServerSpec,
        "command",
        lambda self: [sys.executable, "-m", "bench.fake_server", "--port", str(self.port)],
    )
    with ServerProcess(spec, tmp_path / "server.log").start(timeout_s=60) as process:
        assert process.ready_after_s is not None
        assert process.process is not None and process.process.poll() is None
    assert process.process.poll() is not None


def test_server_process_reports_an_early_exit(tmp_path, monkeypatch):
    monkeypatch.setattr(
        ServerSpec, "command", lambda self: [sys.executable, "-c", "print('bad flag'); raise SystemExit(2)"]
    )
    with pytest.raises(RuntimeError, match="bad flag"):
        ServerProcess(ServerSpec("engine", "m", free_port()), tmp_path / "log").start(timeout_s=30)


def _one_trial(capacity: float, tok_s: float, date: str) -> dict:
    return summarize_trials(
        header={"target": "vllm", "model": "m", "gpu": "NVIDIA H200", "workload": "seed-mix", "date": date},
        sweep_trials=[
            {
                "capacity_req_s": capacity,
                "capacity_still_rising": False,
                "levels": [{"rate": 4.0, "served_req_s": 3.9, "failures": 0}],
            }
        ],
        closed_trials=[[{"concurrency": 1, "output_tok_s": tok_s, "failures": 0}]],
        trials=1,
    )


def test_single_trial_summaries_merge_into_median_min_max(tmp_path):
    parts = [_one_trial(50.0, 450.0, "d1"), _one_trial(52.0, 460.0, "d2"), _one_trial(49.0, 455.0, "d3")]
    merged = merge_summaries(parts)
    assert merged["trials"] == 3 and merged["merged_from"] == ["d1", "d2", "d3"]
    assert (merged["capacity_req_s"], merged["capacity_req_s_min"], merged["capacity_req_s_max"]) == (
        50.0,
        49.0,
        52.0,
    )
    level = merged["closed_loop"][0]
    assert (level["output_tok_s"], level["output_tok_s_min"], level["output_tok_s_max"]) == (
        455.0,
        450.0,
        460.0,
    )
    assert merged["open_loop"][0]["trials"] == 3
    # Through the CLI, into a file that compare and report read.
    paths = []
    for i, part in enumerate(parts):
        paths.append(tmp_path / f"t{i}.json")
        paths[-1].write_text(json.dumps(part))
    out = tmp_path / "merged.json"
    assert bench_main(["merge", *map(str, paths), "--out", str(out)]) == 0
    assert load_result(out).capacity_req_s == 50.0


def test_merge_refuses_mixed_or_multi_trial_inputs():
    with pytest.raises(ValueError, match="single-trial"):
        merge_summaries([dict(_one_trial(1.0, 1.0, "d"), trials=3)])
    other = dict(_one_trial(1.0, 1.0, "d"), target="engine")
    with pytest.raises(ValueError, match="target"):
        merge_summaries([_one_trial(1.0, 1.0, "d"), other])


def test_merge_takes_the_sweep_from_runs_of_their_own(tmp_path):
    closed = [_one_trial(1.0, 450.0, "c1"), _one_trial(2.0, 460.0, "c2"), _one_trial(3.0, 455.0, "c3")]
    sweeps = [_one_trial(50.0, 0.0, "s1"), _one_trial(54.0, 0.0, "s2")]
    for part in sweeps:
        part["closed_loop"] = []  # a sweep-only run
    merged = merge_summaries(closed, sweep_from=sweeps)
    assert merged["capacity_req_s"] == 52.0 and merged["capacity_req_s_min"] == 50.0
    assert merged["closed_loop"][0]["output_tok_s"] == 455.0 and merged["trials"] == 3
    assert merged["sweep_from"] == ["s1", "s2"] and merged["sweep_trials"] == 2
    with pytest.raises(ValueError, match="target"):
        merge_summaries(closed, sweep_from=[dict(sweeps[0], target="engine")])
    paths = {}
    for name, part in [("c1", closed[0]), ("c2", closed[1]), ("s1", sweeps[0]), ("s2", sweeps[1])]:
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(part))
    out = tmp_path / "m.json"
    argv = ["merge", str(paths["c1"]), str(paths["c2"]), "--sweep-from", str(paths["s1"]), str(paths["s2"])]
    assert bench_main([*argv, "--out", str(out)]) == 0
    assert load_result(out).capacity_req_s == 52.0

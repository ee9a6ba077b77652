"""The perf tier's support code: trial folding, budgets, the machine slug, server launching."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from bench.__main__ import main as bench_main
from bench.budgets import (
    ANY_LEVEL,
    Budget,
    BudgetCheck,
    check_closed,
    check_offline,
    check_sweep,
    judged_here,
    load_budgets,
    may_store_baseline,
    shown_only,
    tally,
)
from bench.launch import ServerProcess, ServerSpec, engine_args, free_port, vllm_args
from bench.machine import checkout_engine_version, describe_machine, gpu_slug, same_machine
from bench.results import load_result
from bench.trials import merge_summaries, summarize_trials

BUDGETS_FILE = Path(__file__).resolve().parents[2] / "perf" / "budgets.toml"


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "nvidia-h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert gpu_slug("  A100-SXM4 (40GB) ") == "a100-sxm4-40gb"
    assert gpu_slug(None) == "cpu"


def test_the_checkout_engine_version_is_read_installed_or_not(monkeypatch):
    """Installed (scripts/install.sh): from the package's metadata, without importing the engine;
    run from a checkout that is not installed: the engine package's own."""
    import subprocess
    import sys

    import engine
    from bench import machine

    assert checkout_engine_version() == engine.__version__
    monkeypatch.setattr(machine, "_version", lambda package: None)
    assert checkout_engine_version() == engine.__version__
    script = "import sys; from bench.machine import checkout_engine_version as v; v(); print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", "reading the installed version imported torch"


def test_same_machine_needs_every_field_equal():
    a = {"gpu": "NVIDIA H200", "cpu_model": "EPYC", "cpu_count": 16, "hostname": "h1", "boot_id": "b1"}
    assert same_machine(a, dict(a))
    assert not same_machine(a, dict(a, hostname="h2"))
    assert not same_machine(a, None)
    # two lent VMs named alike, with one CPU model and core count: told apart by their boots
    assert not same_machine(a, dict(a, boot_id="b2"))
    unknown = dict(a, boot_id=None)
    assert not same_machine(unknown, dict(unknown))
    assert same_machine(describe_machine(), describe_machine())  # this machine, this boot


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
    # each trial's value, in trial order, for bench.compare's tests on the trials
    assert summary["capacity_req_s_trials"] == [10.0, 12.0, 11.0]
    assert level["output_tok_s_trials"] == [100.0, 90.0, 110.0] and rate3["served_req_s_trials"] == [2.9]


def test_the_clients_own_load_is_folded_where_levels_have_it_and_absent_where_none_do():
    """A level says whether the client kept up (bench.trials.CLIENT_LOAD_KEYS); summaries stored before
    these figures fold without them, open loop and closed alike."""
    lagging = {"client_loop_lag_p99_s": 0.02, "client_cpu_util": 0.95}
    sweeps = [
        {
            "capacity_req_s": 10.0,
            "capacity_still_rising": False,
            "levels": [{"rate": 2.0, "served_req_s": 2.0, "failures": 0, **lagging}],
        }
    ]
    closed = [
        [{"concurrency": 8, "output_tok_s": v, "failures": 0, "client_cpu_util": u}]
        for v, u in ((1.0, 0.5), (2.0, 0.7))
    ]
    summary = summarize_trials(header={}, sweep_trials=sweeps, closed_trials=closed, trials=2)
    assert summary["open_loop"][0]["client_loop_lag_p99_s"] == 0.02
    (level,) = summary["closed_loop"]
    assert level["client_cpu_util_trials"] == [0.5, 0.7] and "client_loop_lag_p99_s" not in level
    for levels in sweeps[0]["levels"], closed[0]:
        for key in lagging:
            levels[0].pop(key, None)
    bare = summarize_trials(header={}, sweep_trials=sweeps, closed_trials=[closed[0]], trials=1)
    assert not {*lagging} & {*bare["open_loop"][0], *bare["closed_loop"][0]}


def test_the_reviewed_budget_file_loads():
    budgets = load_budgets(BUDGETS_FILE)
    assert {"vllm", "engine"} <= set(budgets)
    for section in budgets.values():
        for levels in section.values():
            for budget in levels.values():
                assert not budget.lenient or budget.reason
    # one budget per closed-loop level of the full profile against vLLM, each its own
    vllm_output = budgets["vllm"]["output_tok_s"]
    assert set(vllm_output) == {"1", "8", "32", "128", "256"}
    assert len({budget.value for budget in vllm_output.values()}) == 5
    rates = {"1", "2", "4", "8", "16", "32", "64"}  # every swept rate under 0.8 x the engine's capacity
    assert set(budgets["vllm"]["ttft_p50_s"]) == set(budgets["vllm"]["tpot_p50_s"]) == rates


def test_lenient_budget_without_reason_is_refused(tmp_path):
    path = tmp_path / "budgets.toml"
    path.write_text("[vllm]\ncapacity_req_s = 0.3\n")
    with pytest.raises(ValueError, match="reason"):
        load_budgets(path)
    path.write_text("[vllm]\ncapacity_req_s = { budget = 0.3, reason = 'not tuned yet' }\nttft_p50_s = 1.5\n")
    assert load_budgets(path)["vllm"]["ttft_p50_s"][ANY_LEVEL].value == 1.5
    path.write_text("[vllm]\nitl_p50_s = 1.5\n")
    with pytest.raises(ValueError, match="not a budgeted metric"):
        load_budgets(path)
    path.write_text("[vllm.output_tok_s]\n1 = 0.6\n8 = 0.3\n")
    with pytest.raises(ValueError, match="output_tok_s at 8 = 0.3 is lenient"):
        load_budgets(path)
    # a plain key after a [table] header lands in that table: refused, not read as a level
    path.write_text("[vllm.tpot_p50_s]\n1 = 1.5\noffline_single_tpot_s = 1.1\n")
    with pytest.raises(ValueError, match="not a rate"):
        load_budgets(path)


def _budgets(**values):
    """{metric: {level: Budget}} from metric=value (any level) or metric={level: value}."""
    return {
        metric: {
            level: Budget(metric, value, "r", level)
            for level, value in (spec.items() if isinstance(spec, dict) else [(ANY_LEVEL, spec)])
        }
        for metric, spec in values.items()
    }


REFERENCE = {
    "capacity_req_s": 10.0,
    "open_loop": [
        {"rate": 2.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01},
        {"rate": 4.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01},
    ],
    "closed_loop": [{"concurrency": 1, "output_tok_s": 100.0}, {"concurrency": 8, "output_tok_s": 1000.0}],
}


def test_budget_checks_read_directions_and_saturation():
    budgets = _budgets(capacity_req_s=0.5, ttft_p50_s=2.0, tpot_p50_s=2.0, output_tok_s=0.5)
    ours = [
        {"rate": 2.0, "ttft_p50_s": 0.15, "tpot_p50_s": 0.03},
        {"rate": 4.0, "ttft_p50_s": 9.0, "tpot_p50_s": 9.0},
    ]
    checks = check_sweep(4.5, ours, REFERENCE, budgets)
    by_name = {(c.level, c.metric): c for c in checks}
    assert not by_name[("sweep", "capacity_req_s")].passed  # 4.5 < 0.5 x 10
    assert by_name[("rate 2/s", "ttft_p50_s")].passed  # 0.15 <= 2 x 0.1
    assert not by_name[("rate 2/s", "tpot_p50_s")].passed  # 0.03 > 2 x 0.01
    assert ("rate 4/s", "ttft_p50_s") not in by_name  # 4 >= 0.8 x 4.5: saturated, not budgeted
    closed = check_closed(8, {"output_tok_s": 600.0}, REFERENCE, budgets)
    assert [c.passed for c in closed] == [True]


def test_each_figure_and_level_has_its_own_budget():
    # distinct budgets, so a check that read another figure's or level's budget would decide otherwise
    budgets = _budgets(
        capacity_req_s=0.9,
        output_tok_s={"1": 0.3, "8": 0.7},
        ttft_p50_s={"2": 1.2},
        tpot_p50_s={"2": 3.0},
    )
    # capacity 0.8x: fails its 0.9 budget (would pass output's 0.7 or 0.3)
    # 1 in flight at 0.4x passes its 0.3; 8 in flight at 0.6x fails its 0.7
    assert [c.passed for c in check_closed(1, {"output_tok_s": 40.0}, REFERENCE, budgets)] == [True]
    assert [c.passed for c in check_closed(8, {"output_tok_s": 600.0}, REFERENCE, budgets)] == [False]
    ours = [{"rate": 2.0, "ttft_p50_s": 0.15, "tpot_p50_s": 0.025}]  # TTFT 1.5x > 1.2, TPOT 2.5x <= 3
    by_name = {(c.level, c.metric): c for c in check_sweep(8.0, ours, REFERENCE, budgets)}
    assert not by_name[("sweep", "capacity_req_s")].passed
    assert not by_name[("rate 2/s", "ttft_p50_s")].passed
    assert by_name[("rate 2/s", "tpot_p50_s")].passed


def test_a_level_without_reference_or_budget_is_a_named_skip():
    budgets = _budgets(output_tok_s={"1": 0.5, "32": 0.5}, ttft_p50_s={"2": 2.0})
    (missing,) = check_closed(32, {"output_tok_s": 1.0}, REFERENCE, budgets)
    assert missing.skipped and not missing.passed and not missing.failed
    assert missing.describe() == "concurrency 32 output_tok_s: skipped, the reference has no concurrency 32"
    (unbudgeted,) = check_closed(8, {"output_tok_s": 1.0}, REFERENCE, budgets)
    assert "no budget for concurrency 8" in unbudgeted.describe()
    checks = check_sweep(10.0, [{"rate": 1.0, "ttft_p50_s": 1.0}], REFERENCE, budgets)
    assert [c.describe() for c in checks] == [
        "rate 1/s ttft_p50_s: skipped, no budget for rate 1 in the budget file"
    ]


def test_rates_match_the_reference_within_a_tolerance():
    budgets = _budgets(ttft_p50_s=2.0)
    ours = [{"rate": 2.0 * 1.004, "ttft_p50_s": 0.3}, {"rate": 4.2, "ttft_p50_s": 0.1}]
    checks = check_sweep(10.0, ours, REFERENCE, budgets)
    assert [(c.level, c.skipped != "", c.failed) for c in checks] == [
        ("rate 2.008/s", False, True),  # matched to 2.0 and held (0.3 > 2 x 0.1)
        ("rate 4.2/s", True, False),  # 5 % away: not the reference's 4
    ]


def test_offline_budgets_by_mode():
    budgets = _budgets(offline_output_tok_s={"all": 1.2}, offline_single_tpot_s=1.1)
    reference = {"offline": {"all": {"output_tok_s": 100.0}, "probes": {"single_tpot_s": 0.002}}}
    ours = {
        "all": {"output_tok_s": 115.0},
        "closed-8": {"output_tok_s": 50.0},
        "probes": {"single_tpot_s": 0.0021},
    }
    described = [c.describe() for c in check_offline(ours, reference, budgets)]
    assert (
        described[0].startswith("offline all output_tok_s: 115 vs reference 100") and "FAILS" in described[0]
    )
    assert "no offline_output_tok_s budget for offline mode 'closed-8'" in described[1]
    assert described[2].startswith("offline probes single_tpot_s") and described[2].endswith("ok")


def test_a_failed_run_is_not_stored_as_a_baseline():
    ok = BudgetCheck("sweep", "capacity_req_s", 5.0, 10.0, 0.5)
    bad = BudgetCheck("sweep", "capacity_req_s", 4.0, 10.0, 0.5)
    skip = BudgetCheck("c", "output_tok_s", math.nan, math.nan, math.nan, skipped="no level")
    assert may_store_baseline([ok, skip], failed_cases=0, force=False) is None
    assert "1 budget check(s) failed" in may_store_baseline([ok, bad], 0, False)
    assert "2 case(s) failed" in may_store_baseline([ok], 2, False)
    assert may_store_baseline([bad], 2, force=True) is None


def test_budget_check_capacity_boundary():
    assert BudgetCheck("sweep", "capacity_req_s", 5.0, 10.0, 0.5).passed
    assert not BudgetCheck("sweep", "capacity_req_s", 4.99, 10.0, 0.5).passed
    assert BudgetCheck("rate 1/s", "ttft_p50_s", 0.2, 0.1, 2.0).passed
    assert not BudgetCheck("rate 1/s", "ttft_p50_s", 0.21, 0.1, 2.0).passed
    assert not BudgetCheck("sweep", "capacity_req_s", math.nan, 10.0, 0.5).passed
    assert "FAILS" in BudgetCheck("sweep", "capacity_req_s", 1.0, 10.0, 0.5).describe()


def test_an_engine_reference_is_judged_only_on_its_own_machine_a_vllm_one_anywhere():
    assert judged_here("engine", same_machine=True)
    assert not judged_here("engine", same_machine=False)
    assert judged_here("vllm", same_machine=False)  # budgets 30 % under the ratio: the hosts' spread


def test_a_shown_check_never_fails_on_its_budget_but_a_broken_figure_does():
    judged = [
        BudgetCheck("offline all", "output_tok_s", 40.0, 100.0, 0.65),  # 0.4x: misses its budget
        BudgetCheck("offline probes", "single_tpot_s", 0.001, 0.002, 1.6),  # holds
        BudgetCheck("concurrency 4", "output_tok_s", math.nan, 100.0, 0.65),  # not a number
        BudgetCheck("concurrency 1", "output_tok_s", math.inf, 100.0, 0.65),
        BudgetCheck("c", "output_tok_s", math.nan, math.nan, math.nan, skipped="no level"),
    ]
    assert [c.failed for c in judged] == [True, False, True, True, False]
    shown = shown_only(judged)
    assert [c.failed for c in shown] == [False, False, True, True, False]
    lines = [c.describe() for c in shown]
    assert lines[0] == (
        "offline all output_tok_s: 40 vs reference 100 = 0.400x (budget >= 0.65x) "
        "shown (reference from another machine)"
    )
    assert lines[2] == "concurrency 4 output_tok_s: not a finite number (budget >= 0.65x) FAILS"
    assert judged[0].describe().endswith("(budget >= 0.65x) FAILS")
    assert tally(shown) == (
        "budgets: 0 judged (0 failed), 2 shown (reference from another machine), 2 broken (failed), 1 skipped"
    )
    assert (
        tally(judged)
        == "budgets: 2 judged (1 failed), 0 shown (reference from another machine), 2 broken (failed), 1 skipped"
    )


def test_an_offline_figure_the_reference_has_and_this_run_lacks_fails_anywhere():
    budgets = _budgets(offline_output_tok_s={"all": 0.65}, offline_prefill_tok_s=0.65)
    reference = {"offline": {"all": {"output_tok_s": 100.0}, "probes": {"prefill_tok_s": 900.0}}}
    ours = {"all": {"output_tok_s": 90.0}}  # the probes entry is gone
    checks = shown_only(check_offline(ours, reference, budgets))
    assert [(c.level, c.metric, c.failed) for c in checks] == [
        ("offline all", "output_tok_s", False),
        ("offline probes", "prefill_tok_s", True),
    ]
    assert checks[1].describe() == (
        "offline probes prefill_tok_s: this run has no offline probes prefill_tok_s (budget >= 0.65x) FAILS"
    )


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


def _trials(capacities: list[float], tok_s: list[float], date: str, offline: list[float] = ()) -> dict:
    """A summary of len(tok_s) trials, folded as the perf tier folds them."""
    return summarize_trials(
        header={"target": "vllm", "model": "m", "gpu": "NVIDIA H200", "workload": "seed-mix", "date": date},
        sweep_trials=[
            {
                "capacity_req_s": c,
                "capacity_still_rising": False,
                "levels": [{"rate": 4.0, "served_req_s": c}],
            }
            for c in capacities
        ],
        closed_trials=[[{"concurrency": 32, "output_tok_s": t, "failures": 0}] for t in tok_s],
        trials=len(tok_s),
        offline_trials=[{"all": {"mode": "all", "output_tok_s": o}} for o in offline],
    )


def _one_trial(capacity: float, tok_s: float, date: str) -> dict:
    return _trials([capacity], [tok_s], date)


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


def test_summaries_of_several_trials_merge_by_pooling_every_trial():
    # Two leases: three trials, then two. The median of the five, not of the two medians (which would
    # be 105.0 here: the medians 100 and 110).
    three = _trials([50.0, 51.0, 52.0], [100.0, 90.0, 101.0], "lease-1", offline=[7.0, 8.0, 9.0])
    two = _trials([60.0, 61.0], [110.0, 120.0], "lease-2", offline=[10.0, 11.0])
    merged = merge_summaries([three, two])
    assert merged["trials"] == 5
    assert merged["merged_from"] == ["lease-1", "lease-2"] and merged["merged_trials"] == [3, 2]
    # Merged again with a third lease's trial, the stored merge still names both of its leases.
    again = merge_summaries([merged, _one_trial(62.0, 130.0, "lease-3")])
    assert again["merged_from"] == ["lease-1", "lease-2", "lease-3"] and again["merged_trials"] == [3, 2, 1]
    assert again["closed_loop"][0]["trials"] == 6
    level = merged["closed_loop"][0]
    assert level["trials"] == 5 and level["output_tok_s_trials"] == [100.0, 90.0, 101.0, 110.0, 120.0]
    assert (level["output_tok_s"], level["output_tok_s_min"], level["output_tok_s_max"]) == (
        101.0,
        90.0,
        120.0,
    )
    assert (merged["capacity_req_s"], merged["capacity_req_s_min"], merged["capacity_req_s_max"]) == (
        52.0,
        50.0,
        61.0,
    )
    assert merged["open_loop"][0]["trials"] == 5 and merged["open_loop"][0]["served_req_s"] == 52.0
    assert merged["offline"]["all"]["trials"] == 5 and merged["offline"]["all"]["output_tok_s"] == 9.0
    # Merging single-trial summaries gives what folding the trials at once gives.
    singles = [
        _trials([c], [t], f"d{i}") for i, (c, t) in enumerate([(50.0, 450.0), (52.0, 460.0), (49.0, 455.0)])
    ]
    at_once = _trials([50.0, 52.0, 49.0], [450.0, 460.0, 455.0], "d0")
    for key in ("closed_loop", "open_loop"):  # as JSON: the figures no trial had are NaN on both sides
        assert json.dumps(merge_summaries(singles)[key]) == json.dumps(at_once[key])


def test_runs_of_different_levels_merge_into_as_many_trials_as_each_level_holds():
    # Three trials cut short after 32 in flight, then the missing level's three trials in another run.
    first = summarize_trials(
        header={"target": "engine", "model": "m", "gpu": "NVIDIA H200", "workload": "seed-mix", "date": "a"},
        sweep_trials=[],
        closed_trials=[
            [{"concurrency": c, "output_tok_s": t, "failures": 0} for c in (1, 32)] for t in (1.0, 2.0, 3.0)
        ],
        trials=3,
    )
    rest = dict(first, date="b", closed_loop=[dict(first["closed_loop"][1], concurrency=256)])
    merged = merge_summaries([first, rest])
    assert [level["concurrency"] for level in merged["closed_loop"]] == [1, 32, 256]
    assert merged["trials"] == 3 and all(level["trials"] == 3 for level in merged["closed_loop"])
    assert merge_summaries([first, dict(rest, closed_loop=first["closed_loop"])])["trials"] == 6


def test_merge_refuses_mixed_inputs_and_figures_it_cannot_pool():
    other = dict(_one_trial(1.0, 1.0, "d"), target="engine")
    with pytest.raises(ValueError, match="target"):
        merge_summaries([_one_trial(1.0, 1.0, "d"), other])
    # A summary of three trials stored without each trial's value: its median cannot be pooled.
    old = _trials([50.0, 51.0, 52.0], [100.0, 90.0, 101.0], "old")
    for level in old["closed_loop"]:
        del level["output_tok_s_trials"]
    with pytest.raises(ValueError, match="output_tok_s folds 3 trials without each trial's value"):
        merge_summaries([old])


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
    # Closed loops measured anew (three trials in one run), the sweep kept from an earlier lease.
    anew = _trials([], [100.0, 90.0, 101.0], "new")
    kept = merge_summaries([anew], sweep_from=[_one_trial(91.0, 0.0, "old")])
    assert kept["trials"] == 3 and kept["closed_loop"][0]["output_tok_s"] == 100.0
    assert kept["capacity_req_s"] == 91.0 and kept["sweep_from"] == ["old"] and kept["sweep_trials"] == 1
    # Re-merged once more, the kept reference still counts its one sweep, not its three closed loops.
    again = merge_summaries([_trials([], [99.0, 98.0, 97.0], "newer")], sweep_from=[kept])
    assert again["sweep_trials"] == 1 and again["capacity_req_s_trials"] == [91.0]
    paths = {}
    for name, part in [("c1", closed[0]), ("c2", closed[1]), ("s1", sweeps[0]), ("s2", sweeps[1])]:
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(part))
    out = tmp_path / "m.json"
    argv = ["merge", str(paths["c1"]), str(paths["c2"]), "--sweep-from", str(paths["s1"]), str(paths["s2"])]
    assert bench_main([*argv, "--out", str(out)]) == 0
    assert load_result(out).capacity_req_s == 52.0

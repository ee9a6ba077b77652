"""`python -m bench offline`: the worker's timing on a pretend target, the offline section's keys and
directions, folding, budgets and compare over it, and the CLI on the tiny model (engine) and without
vLLM (a clear message, no traceback)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from bench import offline_worker
from bench.budgets import ANY_LEVEL, OFFLINE_BUDGETS, Budget, check_offline, load_budgets
from bench.compare import compare_results
from bench.launch import VLLM_ENV_VARIABLE
from bench.metrics import metric_direction, probe_figures
from bench.offline import (
    OfflineConfig,
    OfflineLoad,
    Probes,
    describe_entry,
    summarize_worker,
    worker_command,
)
from bench.results import load_result, read_rows
from bench.trials import fold_offline, merge_summaries, summarize_trials
from bench.workload import Request, WorkloadSpec

REPO = Path(__file__).resolve().parents[3]
BUDGETS_FILE = REPO / "tests" / "perf" / "budgets.toml"
# Keys of an offline entry that name or count what ran rather than measure it: no direction.
IDENTITY_KEYS = {"mode", "concurrency", "n_requests", "completed", "no_text", "duration_s", "steps", "trials"}


class PretendTarget:
    """A step-level engine in miniature: each step gives every unfinished request one token, after
    `step_s` seconds; a request finishes after its max_tokens."""

    step_s = 0.0

    def __init__(self, *options: object) -> None:
        self.remaining: dict[str, int] = {}
        self.added: list[tuple[str, int]] = []

    def add(self, request_id: str, request: Request) -> None:
        self.remaining[request_id] = request.max_tokens
        self.added.append((request_id, request.max_tokens))

    def step(self) -> list[tuple[str, int, bool]]:
        time.sleep(self.step_s)
        advanced = []
        for request_id in list(self.remaining):
            self.remaining[request_id] -= 1
            finished = self.remaining[request_id] == 0
            if finished:
                del self.remaining[request_id]
            advanced.append((request_id, 1, finished))
        return advanced

    def has_unfinished(self) -> bool:
        return bool(self.remaining)

    def reset_step_timing(self) -> None:
        pass

    def step_timing(self) -> dict[str, float]:
        return {"step_prepare_ms": 0.5, "step_execute_ms": 2.0}

    def prefix_cache_counters(self) -> tuple[int, int] | None:
        return None

    def describe(self) -> dict[str, object]:
        return {"name": "pretend", "version": "0", "config": {}}


class CountingTarget(PretendTarget):
    """Counts every added prompt's tokens as looked up in a prefix cache and half of them as found."""

    def __init__(self, *options: object) -> None:
        super().__init__(*options)
        self.queries = self.hits = 0

    def add(self, request_id: str, request: Request) -> None:
        super().add(request_id, request)
        self.queries += request.prompt_len
        self.hits += request.prompt_len // 2

    def prefix_cache_counters(self) -> tuple[int, int] | None:
        return self.queries, self.hits


def test_all_at_once_timestamps_every_token_at_the_end_of_its_step():
    target = PretendTarget()
    spec = WorkloadSpec(kind="fixed", input_len=8, output_len=4)
    result = offline_worker.all_at_once(target, "all", offline_worker.workload(spec, 3), 0, "all")
    assert result.steps == 4 and len(result.rows) == 3
    assert result.step_timing == {"step_prepare_ms": 0.5, "step_execute_ms": 2.0}
    for row in result.rows:
        assert row.ok and row.output_tokens == 4 and row.chunks == 4 and len(row.itls_s) == 3
        assert row.scheduled_s == 0.0 <= row.sent_s <= row.first_token_s <= row.done_s
        assert row.done_s == pytest.approx(row.first_token_s + sum(row.itls_s))
        assert row.tpot_s == pytest.approx(sum(row.itls_s) / 3)


def test_closed_loop_adds_a_request_when_one_finishes_until_the_duration_ends():
    target = PretendTarget()
    target.step_s = 0.01
    spec = WorkloadSpec(kind="fixed", input_len=8, output_len=2)
    result = offline_worker.closed_loop(target, spec, concurrency=2, duration_s=0.1)
    rows = result.rows
    assert 4 <= len(rows) <= 14  # 2 in flight, each 2 steps of >= 10 ms, new ones for 0.1 s
    assert [row.index for row in rows] == list(range(len(rows)))  # the workload's requests from 0
    finished = sorted(row.done_s for row in rows)
    for row in rows[2:]:  # every later request was due when an earlier one finished, before 0.1 s
        assert row.scheduled_s in finished and row.scheduled_s < 0.1
    assert all(row.concurrency == 2 and row.mode == "closed" for row in rows)


@pytest.mark.parametrize("target_class", [offline_worker.EngineTarget, offline_worker.VllmTarget])
def test_both_offline_targets_sample_as_the_workload_says(target_class):
    """The sampling fields reach each target's own SamplingParams (vLLM's has the same names)."""
    made: list[dict[str, object]] = []
    target = target_class.__new__(target_class)  # no model: only the mapping to SamplingParams is tested
    target.sampling = lambda **fields: made.append(fields) or fields
    target.engine = type("Engine", (), {"add_request": lambda self, *args: None})()
    target.aliases = {}
    target.add("r0", Request(0, [1, 2, 3], 3, max_tokens=7, temperature=1.0, top_p=0.95))
    assert made == [{"max_tokens": 7, "temperature": 1.0, "top_p": 0.95, "ignore_eos": True}]


def test_each_mode_counts_the_prefix_cache_lookups_made_in_it_alone(monkeypatch):
    """The counters run since the target's start (warm-up included); a mode's entry holds only what
    grew while it ran, under the HTTP levels' key names, so two targets' modes compare one to one."""
    monkeypatch.setitem(offline_worker.TARGETS, "engine", CountingTarget)
    config = OfflineConfig(
        "engine",
        "unused",
        workload=WorkloadSpec(kind="fixed", input_len=8, output_len=2),
        load=OfflineLoad(
            n_requests=3, concurrencies=(), warmup=2, probes=Probes(single_tokens=0, prefill_prompts=0)
        ),
    )
    result = offline_worker.run(json.loads(json.dumps(config.as_json())), lambda line: None)
    (mode,) = result["modes"]  # the 2 warm-up requests counted too, but not in this mode's entry
    assert mode["prefix_cache"] == {"queries": 3 * 8, "hits": 3 * 4, "hit_rate": 0.5}
    section, _ = summarize_worker(result, "engine")
    entry = section["all"]
    assert (entry["prefix_cache_queries"], entry["prefix_cache_hits"], entry["prefix_cache_hit_rate"]) == (
        24,
        12,
        0.5,
    )
    assert "prefix cache hit rate 0.500" in describe_entry("all", entry)
    # a target without counters: no such keys, and the line says nothing of a cache
    monkeypatch.setitem(offline_worker.TARGETS, "engine", PretendTarget)
    section, _ = summarize_worker(offline_worker.run(config.as_json(), lambda line: None), "engine")
    assert not any(key.startswith("prefix_cache") for key in section["all"])
    assert "prefix cache" not in describe_entry("all", section["all"])


def test_the_vllm_target_reads_its_prefix_cache_counters_from_its_metrics():
    """vLLM's in-process metrics (`LLMEngine.get_metrics`: Counter objects named as on its /metrics,
    one per engine label set); None where its stats are off (vLLM asserts) or name no such counter."""
    counter = type(
        "Counter", (), {"__init__": lambda self, name, value: vars(self).update(name=name, value=value)}
    )
    target = offline_worker.VllmTarget.__new__(offline_worker.VllmTarget)
    metrics = [
        counter("vllm:prefix_cache_queries", 300),
        counter("vllm:prefix_cache_hits", 120),
        counter("vllm:prefix_cache_queries", 100),  # a second engine's labels
        counter("vllm:prompt_tokens", 999),
    ]
    target.engine = type("Engine", (), {"get_metrics": lambda self: metrics})()
    assert target.prefix_cache_counters() == (400, 120)
    metrics[:] = [counter("vllm:prompt_tokens", 999)]
    assert target.prefix_cache_counters() is None

    def stats_off(self):
        raise AssertionError("Stat logging disabled")

    target.engine = type("Engine", (), {"get_metrics": stats_off})()
    assert target.prefix_cache_counters() is None


def test_a_request_that_stops_short_is_a_failure():
    class Short(PretendTarget):
        def step(self) -> list[tuple[str, int, bool]]:
            finished = [(request_id, 1, True) for request_id in self.remaining]
            self.remaining.clear()
            return finished

    result = offline_worker.all_at_once(
        Short(), "all", offline_worker.workload(WorkloadSpec(kind="fixed", output_len=5), 1), 0, "all"
    )
    assert result.rows[0].status == "short" and "got 1 of 5" in result.rows[0].error


def pretend_run(monkeypatch, load: OfflineLoad) -> dict:
    monkeypatch.setitem(offline_worker.TARGETS, "engine", PretendTarget)
    config = OfflineConfig(
        "engine", "unused", workload=WorkloadSpec(kind="fixed", input_len=8, output_len=3), load=load
    )
    return offline_worker.run(json.loads(json.dumps(config.as_json())), lambda line: None)


def test_the_offline_section_holds_http_keys_step_timing_and_probes_each_with_a_direction(monkeypatch):
    load = OfflineLoad(
        n_requests=4, concurrencies=(2,), duration_s=0.01, warmup=1, probes=Probes(16, 6, 3, 32)
    )
    section, rows = summarize_worker(pretend_run(monkeypatch, load), "engine")
    assert list(section) == ["all", "closed-2", "probes"]
    everything = section["all"]
    for key in ("served_req_s", "output_tok_s", "ttft_p50_s", "tpot_p50_s", "itl_p50_s", "e2e_p99_s"):
        assert key in everything  # bench.metrics.summarize's keys, as the HTTP levels have
    assert everything["mode"] == "all" and everything["concurrency"] is None
    assert everything["n_requests"] == everything["completed"] == 4 and everything["failures"] == 0
    assert everything["steps"] == 3 and everything["step_execute_ms"] == 2.0
    assert everything["output_tok_s"] == pytest.approx(12 / everything["duration_s"])
    assert section["closed-2"]["mode"] == "closed" and section["closed-2"]["concurrency"] == 2
    probes = section["probes"]
    assert set(probes) == {"mode", "single_ttft_s", "single_tpot_s", "prefill_tok_s", "failures"}
    assert probes["prefill_tok_s"] > 0 and probes["single_tpot_s"] > 0
    for entry in section.values():
        for key in entry:
            assert key in IDENTITY_KEYS or metric_direction(key) is not None, key
    assert {row.mode for row in rows} == {"all", "closed", "single", "prefill"}
    assert all(row.target == "engine" for row in rows)


def test_directions_of_the_offline_figures():
    assert metric_direction("prefill_tok_s") == "higher"
    for key in ("single_tpot_s", "single_ttft_s", "step_ms", "step_prepare_ms", "step_execute_ms"):
        assert metric_direction(key) == "lower", key
    assert metric_direction("step_ms_min") is None and metric_direction("steps") is None


def test_probe_figures_are_the_single_sequences_tpot_and_prompt_tokens_per_second():
    from bench.metrics import RequestRow

    def row(prompt_len: int, first: float, done: float, tokens: int) -> RequestRow:
        return RequestRow(
            "t", "x", None, None, 0, 0, False, prompt_len, tokens, 0.0, 0.0, first, done, tokens
        )

    figures = probe_figures([row(16, 0.1, 1.1, 11)], [row(4096, 0.5, 0.5, 1), row(4096, 2.0, 2.0, 1)])
    assert figures == {"single_ttft_s": 0.1, "single_tpot_s": pytest.approx(0.1), "prefill_tok_s": 4096.0}
    assert probe_figures([], []) == {}


def entry(output_tok_s: float, step_ms: float, prepare_ms: float) -> dict:
    return {
        "mode": "all",
        "concurrency": None,
        "output_tok_s": output_tok_s,
        "ttft_p50_s": 1.0,
        "failures": 0,
        "step_ms": step_ms,
        "step_prepare_ms": prepare_ms,
        "step_outputs_ms": float("nan"),
    }


def test_fold_offline_takes_median_min_max_per_entry_and_drops_figures_never_measured():
    trials = [
        {"all": entry(100.0, 10.0, 1.0), "probes": {"mode": "probes", "prefill_tok_s": 5.0}},
        {"all": entry(90.0, 12.0, 2.0), "probes": {"mode": "probes", "prefill_tok_s": 7.0}},
        {"all": entry(110.0, 11.0, 3.0)},
    ]
    folded = fold_offline(trials)
    everything = folded["all"]
    assert everything["trials"] == 3 and everything["concurrency"] is None
    assert (everything["output_tok_s"], everything["output_tok_s_min"], everything["output_tok_s_max"]) == (
        100.0,
        90.0,
        110.0,
    )
    assert everything["step_prepare_ms"] == 2.0 and "step_outputs_ms" not in everything
    assert folded["probes"]["trials"] == 2 and folded["probes"]["prefill_tok_s"] == 6.0
    summary = summarize_trials(
        header={"trials": 1}, sweep_trials=[], closed_trials=[], trials=3, offline_trials=trials
    )
    assert summary["offline"] == folded
    assert "offline" not in summarize_trials(header={}, sweep_trials=[], closed_trials=[], trials=1)


def test_merge_folds_single_trial_offline_sections():
    def single(value: float) -> dict:
        summary = summarize_trials(
            header={"target": "engine", "model": "m", "gpu": None, "workload": "seed-mix"},
            sweep_trials=[],
            closed_trials=[],
            trials=1,
            offline_trials=[{"all": entry(value, 10.0, 1.0)}],
        )
        return json.loads(json.dumps(summary))

    merged = merge_summaries([single(100.0), single(80.0), single(90.0)])
    assert merged["offline"]["all"]["output_tok_s"] == 90.0
    assert merged["offline"]["all"]["output_tok_s_min"] == 80.0 and merged["offline"]["all"]["trials"] == 3


def test_offline_budgets_hold_each_figure_by_its_direction():
    budgets = {
        name: {ANY_LEVEL: Budget(name, value)}
        for name, value in [("offline_output_tok_s", 0.5), ("offline_single_tpot_s", 2.0)]
    }
    ours = {
        "all": entry(40.0, 10.0, 1.0),
        "closed-8": entry(60.0, 10.0, 1.0),
        "probes": {"single_tpot_s": 0.03},
    }
    reference = {"offline": {"all": entry(100.0, 5.0, 1.0), "probes": {"single_tpot_s": 0.01}}}
    checks = {(c.level, c.metric): c for c in check_offline(ours, reference, budgets)}
    made = {key for key, check in checks.items() if not check.skipped}
    assert made == {("offline all", "output_tok_s"), ("offline probes", "single_tpot_s")}
    assert not checks[("offline all", "output_tok_s")].passed  # 40 < 0.5 x 100
    assert not checks[("offline probes", "single_tpot_s")].passed  # 0.03 > 2 x 0.01
    # the reference has no closed-8 entry: a skipped check, by name, not a silent pass
    assert (
        "the reference has no offline closed-8 output_tok_s"
        in checks[("offline closed-8", "output_tok_s")].describe()
    )
    assert all(check.skipped for check in check_offline(ours, {"closed_loop": []}, budgets))


def test_the_offline_budgets_follow_the_stored_same_lease_runs():
    budgets = load_budgets(BUDGETS_FILE)
    assert set(OFFLINE_BUDGETS) <= set(budgets["engine"])
    # against vLLM: 15 % past the least favourable of the same-lease H200 runs stored beside the
    # baselines (offline-*/ folders, engine and vLLM in one lease each)
    leases = sorted((REPO / "baselines" / "nvidia-h200" / "qwen2.5-1.5b").glob("offline-*"))
    assert len(leases) >= 4
    runs = [[load_result(lease / f"{t}-run.json").offline for t in ("engine", "vllm")] for lease in leases]
    output = min(e["all"]["output_tok_s"] / v["all"]["output_tok_s"] for e, v in runs)
    single = max(e["probes"]["single_tpot_s"] / v["probes"]["single_tpot_s"] for e, v in runs)
    prefill = min(e["probes"]["prefill_tok_s"] / v["probes"]["prefill_tok_s"] for e, v in runs)
    vllm = budgets["vllm"]
    assert vllm["offline_single_tpot_s"][ANY_LEVEL].value == pytest.approx(single * 1.15, abs=0.01)
    # Those runs made vLLM's engine without a usage context (2,048 tokens and 128 sequences a step, not
    # vllm.LLM's): their configs do not record the limits in force, which the worker now writes, and
    # their all-at-once and prefill ratios (above 1) set nothing.
    targets = [json.loads((lease / "vllm-run.json").read_text())["worker"]["target"] for lease in leases]
    assert not any("max_num_seqs" in target["config"] for target in targets)
    assert output > 1 and prefill > 1
    # All at once and the prefill probe: 30 % past the lease whose vLLM ran at vllm.LLM's limits.
    uncapped = REPO / "baselines" / "nvidia-h200" / "qwen2.5-1.5b" / "chat-offline-2026-12-05"
    engine, reference = (
        json.loads((uncapped / f"{t}-seed-mix.json").read_text()) for t in ("engine", "vllm")
    )
    config = reference["offline_target"]["config"]
    assert (config["max_num_batched_tokens"], config["max_num_seqs"]) == (16384, 1024)
    for metric, entry in (("output_tok_s", "all"), ("prefill_tok_s", "probes")):
        ratio = engine["offline"][entry][metric] / reference["offline"][entry][metric]
        assert vllm[f"offline_{metric}"][ANY_LEVEL].value == pytest.approx(ratio / 1.3, abs=0.01)


def run_json(path: Path, section: dict, target: str) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "run.json").write_text(
        json.dumps({"format": 1, "kind": "offline", "target": target, "levels": [], "offline": section})
    )
    return path


def test_compare_matches_offline_entries_and_names_the_phase(tmp_path):
    base = run_json(
        tmp_path / "base", {"all": entry(100.0, 10.0, 1.0), "probes": {"prefill_tok_s": 50.0}}, "a"
    )
    new = run_json(tmp_path / "new", {"all": entry(80.0, 14.0, 5.0), "closed-8": entry(1.0, 1.0, 1.0)}, "b")
    comparison = compare_results(base, new)
    rows = {(row.level, row.metric): row for row in comparison.rows}
    assert rows[("offline all", "output_tok_s")].regressed  # -20% past the 5% default
    metrics = [row.metric for row in comparison.rows if row.level == "offline all"]
    assert metrics.index("step_ms") + 1 == metrics.index("step_prepare_ms")  # phases right after
    assert rows[("offline all", "step_prepare_ms")].ratio == 5.0
    assert "offline probes (a)" in comparison.unmatched and "offline closed-8 (b)" in comparison.unmatched
    assert load_result(new).offline["closed-8"]["output_tok_s"] == 1.0


def test_compare_shows_the_prefix_cache_hit_rates_side_by_side_without_judging_them(tmp_path):
    """Two targets' hit rates on identical requests, row by row (higher is better); no default limit:
    a cache is judged by the tokens/s it buys, its hit rate is shown beside them."""
    cached = {**entry(100.0, 10.0, 1.0), "prefix_cache_queries": 1000, "prefix_cache_hits": 900}
    base = run_json(tmp_path / "base", {"all": {**cached, "prefix_cache_hit_rate": 0.9}}, "vllm")
    new = run_json(tmp_path / "new", {"all": {**cached, "prefix_cache_hit_rate": 0.6}}, "engine")
    comparison = compare_results(base, new)
    (row,) = [row for row in comparison.rows if row.metric == "prefix_cache_hit_rate"]
    assert (row.level, row.base, row.new, row.direction) == ("offline all", 0.9, 0.6, "higher")
    assert row.limit_pct is None and not row.regressed
    assert not any(row.metric in ("prefix_cache_queries", "prefix_cache_hits") for row in comparison.rows)


def test_describe_entry_reads_a_run_or_a_folded_entry():
    line = describe_entry("all", {**entry(100.0, 10.0, 1.0), "n_requests": 4, "completed": 4, "steps": 3})
    assert line.startswith("all: 4 of 4 requests") and "3 steps of 10.00 ms (prepare 1.00)" in line
    assert "one sequence: 30.00 ms" in describe_entry("probes", {"single_tpot_s": 0.03, "single_ttft_s": 0.1})


def test_the_vllm_worker_is_started_through_the_staged_env(monkeypatch, tmp_path):
    config = OfflineConfig("vllm", "m")
    monkeypatch.setenv(VLLM_ENV_VARIABLE, "/stage/env.sh")
    command = worker_command(config, tmp_path / "c.json", tmp_path / "r.json")
    assert command[:4] == ["bash", "-c", 'source "$0" && exec "$@"', "/stage/env.sh"]
    assert command[4:7] == [sys.executable, "-m", "bench.offline_worker"]
    engine = worker_command(OfflineConfig("engine", "m"), tmp_path / "c.json", tmp_path / "r.json")
    assert engine[:3] == [sys.executable, "-m", "bench.offline_worker"]


def bench_offline(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", "offline", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )


# Small enough for CPU: fixed prompts of 32 tokens, a closed loop of 0.3 s, the probes scaled down.
SMALL = [
    "--dtype", "float32", "--max-model-len", "512", "--workload", "fixed", "--input-len", "32",
    "--output-len", "8", "--n-requests", "4", "--concurrency", "2", "--duration", "0.3", "--warmup", "1",
    "--single-tokens", "8", "--prefill-prompts", "2", "--prefill-prompt-len", "64",
]  # fmt: skip


def test_bench_offline_engine_on_the_tiny_model(tiny_model_dir, tmp_path):
    out = tmp_path / "engine"
    done = bench_offline(["--target", "engine", "--model", str(tiny_model_dir), *SMALL, "--out", str(out)])
    assert done.returncode == 0, done.stderr
    assert "all: 4 of 4 requests" in done.stdout and "probes: one sequence" in done.stdout
    run = json.loads((out / "run.json").read_text())
    assert run["kind"] == "offline" and run["target"] == "engine" and run["levels"] == []
    assert list(run["offline"]) == ["all", "closed-2", "probes"]
    everything = run["offline"]["all"]
    assert everything["completed"] == 4 and everything["failures"] == 0
    assert everything["output_tok_s"] > 0 and everything["ttft_p50_s"] > 0 and everything["tpot_p50_s"] > 0
    phases = {key for key in everything if key.startswith("step_")}
    assert {
        "step_schedule_ms",
        "step_prepare_ms",
        "step_execute_ms",
        "step_update_ms",
        "step_outputs_ms",
    } <= phases
    assert run["offline"]["closed-2"]["completed"] >= 2
    assert run["offline"]["probes"]["prefill_tok_s"] > 0 and run["offline"]["probes"]["single_tpot_s"] > 0
    assert run["worker"]["target"]["name"] == "paged-engine"
    assert run["worker"]["target"]["kernel_compiles"] == 0  # on CPU nothing compiles
    assert run["worker"]["target"]["config"]["max_model_len"] == 512
    assert run["config"]["load"]["probes"]["single_tokens"] == 8
    rows = read_rows(out)
    assert sum(row.mode == "all" for row in rows) == 4 and all(row.ok for row in rows)
    assert load_result(out).offline["all"]["completed"] == 4
    # engine vs itself through compare: every offline entry is matched
    assert not compare_results(out, out).unmatched


def test_bench_offline_vllm_without_vllm_says_so_without_a_traceback(tiny_model_dir, tmp_path):
    try:
        import vllm  # noqa: F401

        pytest.skip("vLLM is installed here")
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k != VLLM_ENV_VARIABLE}
    done = bench_offline(["--target", "vllm", "--model", str(tiny_model_dir)], env)
    assert done.returncode == 1
    assert "error: vLLM is not installed" in done.stderr and VLLM_ENV_VARIABLE in done.stderr
    assert "Traceback" not in done.stderr
    # a staged env that does not provide vLLM: the worker says so, in one line
    stage = tmp_path / "env.sh"
    stage.write_text("export VLLM_STAGED=1\n")
    done = bench_offline(
        ["--target", "vllm", "--model", str(tiny_model_dir), *SMALL], {**env, VLLM_ENV_VARIABLE: str(stage)}
    )
    assert done.returncode == 1
    assert "cannot import vllm in the worker" in done.stderr
    assert "the vllm offline worker exited with status 3" in done.stderr
    assert "Traceback" not in done.stderr


def test_bench_offline_passes_target_options_to_the_engine(tiny_model_dir, tmp_path):
    """--option NAME=VALUE reaches the engine's EngineArgs: the options in force say so, and the run obeys
    them (one sequence at a time: the 4 requests of `all` take at least 4 x 8 steps)."""
    out = tmp_path / "engine"
    options = ["--option", "max_num_seqs=1", "--option", "max_num_batched_tokens=64"]
    done = bench_offline(
        ["--target", "engine", "--model", str(tiny_model_dir), *SMALL, *options, "--out", str(out)]
    )
    assert done.returncode == 0, done.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["options"] == {"max_num_seqs": 1, "max_num_batched_tokens": 64}
    in_force = run["worker"]["target"]["config"]
    assert in_force["max_num_seqs"] == 1 and in_force["max_num_batched_tokens"] == 64
    assert run["offline"]["all"]["steps"] >= 4 * 8


def test_bench_offline_refuses_unknown_target_options(tiny_model_dir):
    done = bench_offline(
        ["--target", "engine", "--model", str(tiny_model_dir), *SMALL, "--option", "max_num_sequences=2"]
    )
    assert done.returncode == 1
    assert "the engine has no option max_num_sequences" in done.stderr and "max_num_seqs" in done.stderr
    assert "Traceback" not in done.stderr
    done = bench_offline(["--target", "engine", "--model", str(tiny_model_dir), "--option", "max_num_seqs"])
    assert done.returncode == 2 and "expected NAME=VALUE" in done.stderr
    done = bench_offline(["--target", "engine", "--model", str(tiny_model_dir), "--option", "dtype=float16"])
    assert done.returncode == 2 and "have their own flags" in done.stderr


def test_bench_offline_refuses_bad_options(tiny_model_dir, tmp_path):
    done = bench_offline(["--target", "engine", "--model", str(tmp_path / "missing")])
    assert done.returncode == 2 and "not a folder" in done.stderr
    done = bench_offline(["--target", "engine", "--model", str(tiny_model_dir), "--single-tokens", "1"])
    assert done.returncode == 2 and "at least 2 tokens" in done.stderr


def test_the_report_has_an_offline_table(tmp_path):
    from bench.report import write_report

    base = run_json(tmp_path / "a", {"all": entry(100.0, 10.0, 1.0), "probes": {"prefill_tok_s": 50.0}}, "a")
    new = run_json(tmp_path / "b", {"all": entry(80.0, 14.0, 5.0), "closed-8": entry(1.0, 1.0, 1.0)}, "b")
    page = write_report([base, new], tmp_path / "report.html").read_text()
    assert "Offline: the step-level engine driven in process" in page
    assert "closed-8" in page and "prepare ms" in page and "No levels" not in page


def test_the_vllm_target_is_made_as_vllm_offline_api_makes_it(monkeypatch):
    """vLLM picks its step limits from the usage context: `vllm.LLM` passes LLM_CLASS (16,384 tokens
    and 1,024 sequences a step on an H200), while `LLMEngine.from_engine_args`' default context falls
    back to 2,048 and 128. The target passes LLM_CLASS, and run.json records the limits in force."""
    usage = types.SimpleNamespace(ENGINE_CONTEXT="ENGINE_CONTEXT", LLM_CLASS="LLM_CLASS")
    limits = {"LLM_CLASS": (16384, 1024), "ENGINE_CONTEXT": (2048, 128)}
    made: list[str] = []

    class FakeEngine:
        @classmethod
        def from_engine_args(cls, engine_args, usage_context=usage.ENGINE_CONTEXT):
            made.append(usage_context)
            engine = cls()
            tokens, seqs = limits[usage_context]
            engine.vllm_config = types.SimpleNamespace(
                scheduler_config=types.SimpleNamespace(max_num_batched_tokens=tokens, max_num_seqs=seqs)
            )
            engine.get_metrics = lambda: []
            return engine

    fake = types.ModuleType("vllm")
    fake.__version__ = "0.0-fake"
    fake.SamplingParams = dict
    fake.EngineArgs = lambda **options: options
    fake.LLMEngine = FakeEngine
    usage_lib = types.ModuleType("vllm.usage.usage_lib")
    usage_lib.UsageContext = usage
    for name, module in {
        "vllm": fake,
        "vllm.usage": types.ModuleType("vllm.usage"),
        "vllm.usage.usage_lib": usage_lib,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)

    target = offline_worker.VllmTarget("model-dir", "bfloat16", 4352, 0, {})
    assert made == ["LLM_CLASS"]
    config = target.describe()["config"]
    assert (config["max_num_batched_tokens"], config["max_num_seqs"]) == (16384, 1024)
    assert config["enable_prefix_caching"] is False and config["max_model_len"] == 4352


def test_an_offline_figure_with_no_budget_is_skipped_by_name(tmp_path):
    """A figure both runs have but the budget file does not hold is listed as skipped, naming the
    budget, never left out: the file's rule for every level without a budget."""
    path = tmp_path / "budgets.toml"
    path.write_text("[vllm]\noffline_single_tpot_s = 1.1\n")
    budgets = load_budgets(path)["vllm"]
    ours = {"all": {"output_tok_s": 90.0}, "probes": {"single_tpot_s": 0.002, "prefill_tok_s": 9e4}}
    theirs = {"all": {"output_tok_s": 100.0}, "probes": {"single_tpot_s": 0.002, "prefill_tok_s": 1e5}}
    checks = {(c.level, c.metric): c for c in check_offline(ours, {"offline": theirs}, budgets)}
    assert set(checks) == {
        ("offline all", "output_tok_s"),
        ("offline probes", "single_tpot_s"),
        ("offline probes", "prefill_tok_s"),
    }
    assert "offline_output_tok_s" in checks[("offline all", "output_tok_s")].skipped
    assert "offline_prefill_tok_s" in checks[("offline probes", "prefill_tok_s")].skipped
    held = checks[("offline probes", "single_tpot_s")]
    assert not held.skipped and not held.failed

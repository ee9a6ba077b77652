"""Sampled workloads in the perf tier: each case runs greedy and sampled (temperature 1.0, top_p 0.95),
each mode with its own summary file, reference, budget section and stored baseline.

The tier runs against bench's fake server (`--server-url`), which records every request body it gets
(`recording_fake_server`), so a test sees what each mode sent; the support code (budget sections,
profiles' modes, merge, compare's note, the report's sections) is tested directly."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from perf_tier_process import run_perf_tier

import bench.fake_server
from bench.budgets import budget_section, check_closed, load_budgets
from bench.compare import compare_results
from bench.fake_server import FakeServerConfig, FakeServerThread
from bench.machine import describe_machine
from bench.profiles import PROFILES, Profile, seed_mix
from bench.report import write_report
from bench.trials import merge_summaries, sampling_header, summarize_trials, summary_name
from bench.workload import SAMPLED, SEED_MIX_OUTPUT_LENS, WorkloadSpec

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def recording_fake_server() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """The fake server in a thread of this process, with every completion request's body appended to
    the list it yields beside its URL (bench.fake_server's app, wrapped; the tier runs in a child)."""
    bodies: list[dict[str, Any]] = []
    create_app = bench.fake_server.create_app

    def recording_app(config: FakeServerConfig) -> Any:
        app = create_app(config)

        async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
            if scope["type"] != "http" or not scope["path"].endswith("/completions"):
                return await app(scope, receive, send)
            chunks: list[bytes] = []

            async def recorded() -> dict[str, Any]:
                message = await receive()
                chunks.append(message.get("body", b""))
                if not message.get("more_body"):
                    bodies.append(json.loads(b"".join(chunks)))
                return message

            return await app(scope, recorded, send)

        return asgi

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(bench.fake_server, "create_app", recording_app)
        with FakeServerThread(FakeServerConfig(ttft_s=0.005, itl_s=0.0005)) as fake:
            yield fake.base_url, bodies


def perf_tier(
    url: str, out: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The smoke profile against the server at `url`, one trial; ARGS choose the cases (`-k`)."""
    arguments = ["-rs", "--server-url", url, "--profile", "smoke", "--trials", "1", "--perf-out", str(out)]
    return run_perf_tier([*arguments, *args], timeout_s=120, env=env)


def workload_sampling(bodies: list[dict[str, Any]]) -> set[tuple[float, float | None]]:
    """(temperature, top_p) of the seed-mix requests among `bodies` (not the probe's short request)."""
    return {(b["temperature"], b.get("top_p")) for b in bodies if b["max_tokens"] in SEED_MIX_OUTPUT_LENS}


def sections(stdout: str) -> dict[str, list[str]]:
    """The terminal summary's lines by record: `engine` and `engine, sampled (...)` -> their lines."""
    found: dict[str, list[str]] = {}
    current = None
    for line in stdout.splitlines():
        if re.match(r"^(engine|vllm)\b.*: capacity", line):
            current = line.split(": capacity")[0]
            found[current] = []
        elif current is not None and line.startswith("  "):
            found[current].append(line.strip())
        else:
            current = None
    return found


SAMPLED_TITLE = "engine, sampled (temperature 1, top_p 0.95)"


def reference(path: Path, mode: str, output_tok_s: float, machine: dict[str, Any] | None) -> Path:
    """A stored engine reference of `mode` at 4 in flight, measured on `machine`."""
    summary = {
        "target": "engine",
        "date": f"2026-01-01-{mode}",
        **sampling_header(mode),
        "trials": 3,
        "capacity_req_s": None,
        "open_loop": [],
        "closed_loop": [{"concurrency": 4.0, "trials": 3, "output_tok_s": output_tok_s}],
        "machine": machine,
    }
    path.write_text(json.dumps(summary))
    return path


def test_each_mode_sends_its_sampling_and_is_summarized_in_its_own_file(recording_fake_server, tmp_path):
    url, bodies = recording_fake_server
    bodies.clear()
    run = perf_tier(url, tmp_path / "both", "-k", "closed_loop and 4", "--model", "sampling-test-model")
    assert run.returncode == 0, run.stdout[-2000:]
    assert workload_sampling(bodies) == {(0.0, None), (1.0, 0.95)}  # greedy sends no top_p
    greedy = json.loads((tmp_path / "both" / "engine-seed-mix.json").read_text())
    sampled = json.loads((tmp_path / "both" / "engine-seed-mix-sampled.json").read_text())
    assert (greedy["sampling"], greedy["temperature"], greedy["top_p"]) == ("greedy", 0.0, 1.0)
    assert (sampled["sampling"], sampled["temperature"], sampled["top_p"]) == ("sampled", 1.0, 0.95)
    assert [level["concurrency"] for level in greedy["closed_loop"]] == [4.0]
    assert [level["concurrency"] for level in sampled["closed_loop"]] == [4.0]
    assert set(sections(run.stdout)) == {"engine", SAMPLED_TITLE}
    report = (tmp_path / "both" / "report.html").read_text()
    assert "<h2>Greedy</h2>" in report and "<h2>Sampled (temperature 1, top_p 0.95)</h2>" in report

    # -k sampled: only the sampled cases, the server warmed up in that mode alone, one file.
    bodies.clear()
    run = perf_tier(
        url, tmp_path / "sampled", "-k", "closed_loop and sampled", "--model", "sampling-test-model"
    )
    assert run.returncode == 0, run.stdout[-2000:]
    assert workload_sampling(bodies) == {(1.0, 0.95)}
    assert sorted(path.name for path in (tmp_path / "sampled").glob("*.json")) == [
        "engine-seed-mix-sampled.json"
    ]


def test_each_mode_runs_the_cases_its_profile_gives_it():
    # the CPU smoke: sampled only at 4 in flight and offline, no sweep (CI time), text prompts at 4 in
    # flight; the GPU profiles' cases: test_profiles_choose_their_modes_and_the_sampled_cases
    done = run_perf_tier(["--collect-only", "--profile", "smoke", "--model", "tiny"], timeout_s=60)
    assert done.returncode == 0, done.stdout[-2000:]
    assert [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line] == [
        "test_offline[greedy-engine]",
        "test_offline[sampled-engine]",
        "test_open_loop_sweep[greedy-engine]",
        "test_closed_loop[greedy-1-engine]",
        "test_closed_loop[greedy-4-engine]",
        "test_closed_loop[sampled-4-engine]",
        "test_closed_loop[text-4-engine]",
    ]


def write_budgets(path: Path, text: str) -> dict[str, str]:
    path.write_text(text)
    return {"PERF_BUDGETS": str(path)}


def test_a_sampled_budget_section_holds_the_sampled_figures_only(recording_fake_server, tmp_path):
    url, _ = recording_fake_server
    # Distinct budgets, so a figure held to the other mode's budget would show it; references 1e7 tok/s
    # from this machine: both judged, both fail.
    env = write_budgets(
        tmp_path / "budgets.toml",
        "[engine.output_tok_s]\n4 = 0.61\n\n[engine.sampled.output_tok_s]\n4 = 0.83\n",
    )
    here = describe_machine()
    greedy = reference(tmp_path / "greedy.json", "greedy", 1e7, here)
    sampled = reference(tmp_path / "sampled.json", "sampled", 1e7, here)
    args = ["-k", "closed_loop and 4", "--baseline", str(sampled), "--baseline", str(greedy)]
    run = perf_tier(url, tmp_path / "out", *args, env=env)
    assert run.returncode == 1, run.stdout[-2000:]
    lines = sections(run.stdout)
    (greedy_check,) = [line for line in lines["engine"] if line.startswith("concurrency 4 output_tok_s")]
    (sampled_check,) = [
        line for line in lines[SAMPLED_TITLE] if line.startswith("concurrency 4 output_tok_s")
    ]
    assert "(budget >= 0.61x) FAILS" in greedy_check, greedy_check
    assert "(budget >= 0.83x) FAILS" in sampled_check, sampled_check
    assert any(f"against stored {greedy}" in line for line in lines["engine"])
    assert any(f"against stored {sampled}" in line for line in lines[SAMPLED_TITLE])


def test_a_mode_without_its_budget_section_is_skipped_by_name(recording_fake_server, tmp_path):
    url, _ = recording_fake_server
    env = write_budgets(tmp_path / "greedy-only.toml", "[engine.output_tok_s]\n4 = 0.61\n")
    here = describe_machine()
    greedy = reference(tmp_path / "greedy.json", "greedy", 1.0, here)  # slow: greedy passes
    sampled = reference(tmp_path / "sampled.json", "sampled", 1.0, here)
    args = ["-k", "closed_loop and 4 and not text", "--baseline", str(greedy), "--baseline", str(sampled)]
    run = perf_tier(url, tmp_path / "out", *args, env=env)
    assert run.returncode == 0, run.stdout[-2000:]
    assert "1 passed, 1 skipped" in run.stdout
    lines = sections(run.stdout)
    assert any(line.endswith("(budget >= 0.61x) ok") for line in lines["engine"]), lines["engine"]
    skipped = "concurrency 4 output_tok_s: skipped, greedy-only.toml has no [engine.sampled] budgets"
    assert skipped in lines[SAMPLED_TITLE], lines[SAMPLED_TITLE]
    assert (
        "budgets: 0 judged (0 failed), 0 shown (reference from another machine), 1 skipped"
        in lines[SAMPLED_TITLE]
    )
    required = perf_tier(url, tmp_path / "required", *args, env={**env, "PERF_REQUIRE_REFERENCE": "1"})
    assert required.returncode == 1, required.stdout[-2000:]
    assert "has no [engine.sampled] budgets" in required.stdout
    assert "a case with nothing to hold it to fails" in required.stdout


HOW_TO_STORE = "pytest -m perf tests/perf --target vllm -k sampled --save-baseline"


def test_a_missing_sampled_reference_is_a_skip_or_a_failure_that_says_how_to_store_one(
    recording_fake_server, tmp_path
):
    url, _ = recording_fake_server
    args = ["-k", "closed_loop and sampled", "--model", "no-such-model"]
    plain = perf_tier(url, tmp_path / "a", *args)
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout[-2000:]
    message = " ".join(plain.stdout.split())  # the skip reason, wrapped by the terminal
    assert "no baseline for cpu/no-such-model (sampled: looked for" in message and HOW_TO_STORE in message
    assert "baselines/cpu/no-such-model/vllm-seed-mix-sampled.json" in message
    required = perf_tier(url, tmp_path / "b", *args, env={"PERF_REQUIRE_REFERENCE": "1"})
    assert required.returncode == 1, required.stdout[-2000:]
    assert "1 failed" in required.stdout and HOW_TO_STORE in " ".join(required.stdout.split())


def test_save_baseline_stores_the_sampled_summary_and_the_next_run_is_held_to_it(
    recording_fake_server, tmp_path
):
    url, _ = recording_fake_server
    model = "gate-sampling-test-model"  # stored under baselines/cpu/<model>/, removed afterwards
    stored = REPO / "baselines" / "cpu" / model
    assert not stored.exists()
    try:
        args = ["-k", "closed_loop and sampled", "--model", model]
        run = perf_tier(url, tmp_path / "store", *args, "--save-baseline")
        assert run.returncode == 0, run.stdout[-2000:]
        assert sorted(path.name for path in stored.iterdir()) == ["engine-seed-mix-sampled.json"]
        assert json.loads((stored / "engine-seed-mix-sampled.json").read_text())["sampling"] == "sampled"
        again = perf_tier(url, tmp_path / "again", *args)
        assert again.returncode == 0, again.stdout[-2000:]
        # held to it (judged: this machine stored it), or skipped naming it where budgets.toml has no
        # [engine.sampled] section
        assert f"stored baselines/cpu/{model}/engine-seed-mix-sampled.json" in " ".join(again.stdout.split())
        assert (tmp_path / "again" / "reference-for-engine-seed-mix-sampled.json").is_file()
    finally:
        shutil.rmtree(stored, ignore_errors=True)


# -- the support code ------------------------------------------------------------------------------
def test_budget_sections_by_sampling_mode(tmp_path):
    path = tmp_path / "budgets.toml"
    path.write_text(
        "[vllm]\ncapacity_req_s = 0.65\n\n[vllm.output_tok_s]\n1 = 0.9\n\n"
        "[vllm.sampled]\ncapacity_req_s = 0.3\n\n[vllm.sampled.output_tok_s]\n1 = 0.35\n"
    )
    with pytest.raises(ValueError, match="lenient"):  # sections are read like the greedy ones
        load_budgets(path)
    path.write_text(path.read_text().replace("capacity_req_s = 0.3", "capacity_req_s = 0.55"))
    path.write_text(path.read_text().replace("1 = 0.35", "1 = { budget = 0.35, reason = 'sampled at 0.4x' }"))
    budgets = load_budgets(path)
    assert budget_section("vllm", "greedy") == "vllm" and budget_section("vllm", "sampled") == "vllm.sampled"
    assert set(budgets) == {"vllm", "vllm.sampled"}
    assert budgets["vllm"]["capacity_req_s"]["*"].value == 0.65
    assert budgets["vllm.sampled"]["capacity_req_s"]["*"].value == 0.55
    reference = {"closed_loop": [{"concurrency": 1, "output_tok_s": 100.0}]}
    ours = {"output_tok_s": 50.0}  # 0.5x: passes the sampled budget, fails the greedy one
    assert [c.passed for c in check_closed(1, ours, reference, budgets["vllm.sampled"])] == [True]
    assert [c.passed for c in check_closed(1, ours, reference, budgets["vllm"])] == [False]
    path.write_text("[vllm.greedy]\ncapacity_req_s = 0.65\n")
    with pytest.raises(ValueError, match=r"no \[vllm.greedy\]"):
        load_budgets(path)


def test_profiles_choose_their_modes_and_the_sampled_cases():
    smoke = PROFILES["smoke"].for_mode("sampled")
    assert smoke.sweep is None and smoke.concurrencies == (4,) and smoke.offline == PROFILES["smoke"].offline
    assert PROFILES["smoke"].for_mode("greedy") == PROFILES["smoke"]
    for name in ("full", "short"):
        assert PROFILES[name].sampling == ("greedy", "sampled")
        # sampled at every closed-loop level and offline, no sweep
        sampled = PROFILES[name].for_mode("sampled")
        assert sampled.sweep is None and PROFILES[name].sweep is not None
        assert sampled.concurrencies == PROFILES[name].concurrencies
        assert sampled.offline == PROFILES[name].offline
    assert seed_mix("sampled") == WorkloadSpec(kind="seed-mix", seed=0, **SAMPLED)
    assert seed_mix("greedy", seed=1) == WorkloadSpec(kind="seed-mix", seed=1)
    base = PROFILES["smoke"]
    with pytest.raises(ValueError, match="unknown sampling modes"):
        Profile(**{**base.__dict__, "sampling": ("nucleus",)})
    with pytest.raises(ValueError, match="not in"):
        Profile(**{**base.__dict__, "sampled_concurrencies": (64,)})


def one_trial(mode: str | None, tok_s: float, date: str) -> dict[str, Any]:
    """A single-trial summary of `mode` (None: stored before summaries said how they sampled)."""
    header = {"target": "vllm", "model": "m", "gpu": "NVIDIA H200", "workload": "seed-mix", "date": date}
    return summarize_trials(
        header={**header, **(sampling_header(mode) if mode else {})},
        sweep_trials=[],
        closed_trials=[[{"concurrency": 8, "output_tok_s": tok_s, "failures": 0}]],
        trials=1,
    )


def test_merge_folds_one_mode_and_refuses_a_mix():
    merged = merge_summaries([one_trial("sampled", v, f"d{v}") for v in (90.0, 100.0, 95.0)])
    assert (merged["sampling"], merged["temperature"], merged["top_p"]) == ("sampled", 1.0, 0.95)
    assert merged["closed_loop"][0]["output_tok_s"] == 95.0 and merged["trials"] == 3
    with pytest.raises(ValueError, match="sampling"):
        merge_summaries([one_trial("greedy", 1.0, "a"), one_trial("sampled", 1.0, "b")])
    # a greedy trial stored before summaries named their mode merges with a new greedy one
    assert merge_summaries([one_trial(None, 1.0, "a"), one_trial("greedy", 2.0, "b")])["trials"] == 2


def test_summary_files_are_named_by_mode():
    assert summary_name("engine", "greedy") == "engine-seed-mix.json"  # the stored baselines' name
    assert summary_name("vllm", "sampled") == "vllm-seed-mix-sampled.json"
    assert summary_name("base", "sampled") == "base-seed-mix-sampled.json"


def test_compare_says_when_the_two_sides_sampled_differently(tmp_path):
    paths = {}
    for mode in ("greedy", "sampled"):
        paths[mode] = tmp_path / summary_name("engine", mode)
        paths[mode].write_text(json.dumps(one_trial(mode, 100.0, mode)))
    old = tmp_path / "stored-before.json"  # no sampling keys: greedy
    old.write_text(json.dumps(one_trial(None, 100.0, "old")))
    mixed = compare_results(paths["greedy"], paths["sampled"])
    assert mixed.sampling_note is not None
    assert "base is greedy, new is sampled (temperature 1, top_p 0.95)" in mixed.table()
    assert mixed.sampling_note in mixed.markdown()
    assert compare_results(old, paths["greedy"]).sampling_note is None
    assert compare_results(paths["sampled"], paths["sampled"]).sampling_note is None


def test_the_report_gives_each_mode_its_section_and_keeps_target_names(tmp_path):
    paths = []
    for mode in ("greedy", "sampled"):
        summary = dict(one_trial(mode, 100.0, mode), target="engine")
        paths.append(tmp_path / summary_name("engine", mode))
        paths[-1].write_text(json.dumps(summary))
    page = write_report(paths, tmp_path / "report.html").read_text()
    greedy_at, sampled_at = (
        page.index("<h2>Greedy</h2>"),
        page.index("<h2>Sampled (temperature 1, top_p 0.95)</h2>"),
    )
    assert greedy_at < sampled_at
    # one closed-loop figure a mode, each with its own table; the target keeps its name in both
    assert page.count("<h3>Closed loop") == 2 and page.count("data:image/png;base64,") == 2
    assert "engine (" not in page
    one_mode = write_report(paths[:1], tmp_path / "one.html").read_text()
    assert "<h2>Closed loop" in one_mode and "<h2>Greedy</h2>" not in one_mode


def test_the_reviewed_file_budgets_the_smokes_sampled_levels():
    budgets = load_budgets(REPO / "tests" / "perf" / "budgets.toml")
    sampled = budgets[budget_section("engine", "sampled")]
    assert set(sampled["output_tok_s"]) == {
        str(c) for c in PROFILES["smoke"].for_mode("sampled").concurrencies
    }
    assert {"offline_output_tok_s", "offline_prefill_tok_s", "offline_single_tpot_s"} <= set(sampled)

"""The perf tier's prompt modes: the seed-mix sent as text prompts (`text`) and as chat completions
(`chat`), greedy, each with its own summary file, reference and budget section, as the sampling modes.

The tier runs against bench's fake server, which records every request body it gets (the fixture of
test_perf_sampling), with the tiny model's folder as --model so the text is made with its tokenizer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from perf_tier_process import run_perf_tier
from test_perf_sampling import recording_fake_server, sections  # noqa: F401 (a fixture)

from bench.__main__ import main
from bench.budgets import load_budgets
from bench.machine import describe_machine
from bench.profiles import PROFILES, seed_mix
from bench.report import write_report
from bench.trials import case_mode, merge_summaries, sampling_header, summary_name
from bench.workload import SEED_MIX_OUTPUT_LENS

TEXT_TITLE = "engine, text prompts"


def tier(url: str, out: Path, model: Path, profile: str, *args: str, env: dict[str, str] | None = None):
    arguments = ["-rs", "--server-url", url, "--profile", profile, "--trials", "1", "--perf-out", str(out)]
    return run_perf_tier([*arguments, "--model", str(model), *args], timeout_s=180, env=env)


def workload_bodies(bodies: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The seed-mix requests among `bodies` (not the probe's short request)."""
    return [b for b in bodies if b["max_tokens"] in SEED_MIX_OUTPUT_LENS]


def reference(path: Path, target: str, mode: str, output_tok_s: float, concurrency: float) -> Path:
    summary = {
        "target": target,
        "date": f"2026-01-01-{mode}",
        **sampling_header(mode),
        "trials": 3,
        "capacity_req_s": None,
        "open_loop": [],
        "closed_loop": [{"concurrency": concurrency, "trials": 3, "output_tok_s": output_tok_s}],
        "machine": describe_machine(),
    }
    path.write_text(json.dumps(summary))
    return path


def test_the_text_mode_sends_text_of_the_seed_mix_lengths_into_its_own_file(
    recording_fake_server,  # noqa: F811
    tiny_model_dir,
    tmp_path,
):
    url, bodies = recording_fake_server
    bodies.clear()
    run = tier(url, tmp_path / "out", tiny_model_dir, "smoke", "-k", "text")
    assert run.returncode == 0, run.stdout[-2000:]
    sent = workload_bodies(bodies)
    assert sent and all(isinstance(b["prompt"], str) and b["temperature"] == 0.0 for b in sent)
    assert sorted(path.name for path in (tmp_path / "out").glob("*.json")) == ["engine-seed-mix-text.json"]
    summary = json.loads((tmp_path / "out" / "engine-seed-mix-text.json").read_text())
    assert (summary["mode"], summary["prompt_format"], summary["api"]) == ("text", "text", "completions")
    assert (summary["sampling"], summary["temperature"]) == ("greedy", 0.0)
    assert [level["concurrency"] for level in summary["closed_loop"]] == [4.0]
    assert set(sections(run.stdout)) == {TEXT_TITLE}
    message = " ".join(run.stdout.split())
    assert "no baseline for cpu/" in message and "(text: looked for" in message
    assert "-k text --save-baseline" in message
    assert "<h2>Greedy, text prompts</h2>" not in (tmp_path / "out" / "report.html").read_text()  # one group


def test_a_text_budget_section_holds_the_text_figures(recording_fake_server, tiny_model_dir, tmp_path):  # noqa: F811
    url, _ = recording_fake_server
    budgets = tmp_path / "budgets.toml"
    budgets.write_text("[engine.output_tok_s]\n4 = 0.61\n\n[engine.text.output_tok_s]\n4 = 0.83\n")
    stored = reference(tmp_path / "text.json", "engine", "text", 1e7, 4.0)  # this machine: judged
    run = tier(
        url, tmp_path / "out", tiny_model_dir, "smoke", "-k", "text", "--baseline", str(stored),
        env={"PERF_BUDGETS": str(budgets)},
    )  # fmt: skip
    assert run.returncode == 1, run.stdout[-2000:]
    (check,) = [line for line in sections(run.stdout)[TEXT_TITLE] if "output_tok_s" in line]
    assert "(budget >= 0.83x) FAILS" in check, check


def test_the_gpu_profiles_run_text_and_chat_at_every_closed_loop_level():
    """Collected only (a chat run goes through the same machinery as the text run above, its body
    and stream tested in test_bench_chat.py): the short profile's prompt-mode cases."""
    done = run_perf_tier(["--collect-only", "--profile", "short", "--model", "tiny"], timeout_s=60)
    assert done.returncode == 0, done.stdout[-2000:]
    names = [line.split("::")[1] for line in done.stdout.splitlines() if "::" in line]
    prompt_cases = [name for name in names if "[text-" in name or "[chat-" in name]
    assert prompt_cases == [
        "test_closed_loop[text-1-engine]",
        "test_closed_loop[text-128-engine]",
        "test_closed_loop[chat-1-engine]",
        "test_closed_loop[chat-128-engine]",
    ]
    assert not [name for name in names if name.startswith(("test_offline[text", "test_offline[chat"))]


# -- the support code ------------------------------------------------------------------------------
def test_profiles_run_the_prompt_modes_in_closed_loops_only():
    full = PROFILES["full"]
    assert full.modes == ("greedy", "sampled", "text", "chat")
    for mode in ("text", "chat"):
        assert full.for_mode(mode).sweep is None
        assert full.for_mode(mode).concurrencies == full.concurrencies
    smoke = PROFILES["smoke"]
    assert smoke.prompt_modes == ("text",) and smoke.for_mode("text").concurrencies == (4,)
    assert PROFILES["short"].sampling == ("greedy", "sampled")  # bench ab's modes: unchanged
    with pytest.raises(ValueError, match="tokenizer"):
        seed_mix("text")
    assert seed_mix("chat", tokenizer="/m").api == "chat"


def test_the_prompt_modes_have_their_own_files_sections_and_merges(tmp_path):
    assert summary_name("vllm", "text") == "vllm-seed-mix-text.json"
    assert summary_name("engine", "chat") == "engine-seed-mix-chat.json"
    path = tmp_path / "budgets.toml"
    path.write_text("[vllm]\ncapacity_req_s = 0.65\n\n[vllm.chat.output_tok_s]\n1 = 0.9\n")
    budgets = load_budgets(path)
    assert set(budgets) == {"vllm", "vllm.chat"}
    assert budgets["vllm.chat"]["output_tok_s"]["1"].value == 0.9

    def one_trial(mode: str) -> dict[str, Any]:
        header = {"target": "engine", "model": "m", "gpu": None, "workload": "seed-mix", "date": mode}
        return {**header, **sampling_header(mode), "trials": 1, "capacity_req_s": None, "closed_loop": []}

    merged = merge_summaries([one_trial("chat"), one_trial("chat")])
    assert case_mode(merged) == "chat" and merged["api"] == "chat"
    with pytest.raises(ValueError, match="prompt mode"):
        merge_summaries([one_trial("greedy"), one_trial("text")])


def test_the_report_draws_text_and_token_ids_apart(tmp_path):
    def summary(mode: str) -> Path:
        level = {"concurrency": 4.0, "output_tok_s": 10.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01}
        body = {"target": f"engine-{mode}", **sampling_header(mode), "open_loop": [], "closed_loop": [level]}
        path = tmp_path / f"{mode}.json"
        path.write_text(json.dumps(body))
        return path

    page = Path(write_report([summary("greedy"), summary("text")], tmp_path / "r.html")).read_text()
    assert "<h2>Greedy</h2>" in page and "<h2>Greedy, text prompts</h2>" in page


def test_compare_notes_a_text_result_held_to_a_token_id_one(tmp_path):
    from bench.compare import compare_results

    def summary(mode: str) -> Path:
        level = {"concurrency": 4.0, "output_tok_s": 10.0, "failures": 0}
        body = {"target": "engine", **sampling_header(mode), "open_loop": [], "closed_loop": [level]}
        path = tmp_path / f"{mode}.json"
        path.write_text(json.dumps(body))
        return path

    note = compare_results(summary("greedy"), summary("chat")).sampling_note
    assert note is not None and "base is greedy, new is greedy, chat completions" in note
    assert compare_results(summary("text"), summary("text")).sampling_note is None


def test_report_png_draws_the_plots_a_document_shows_and_refuses_mixed_workloads(tmp_path, capsys):
    def summary(name: str, mode: str, open_loop: bool) -> str:
        closed = {"concurrency": 4.0, "output_tok_s": 10.0, "ttft_p50_s": 0.1, "tpot_p50_s": 0.01}
        rate = {"rate": 2.0, "served_req_s": 1.9, "ttft_p50_s": 0.1, "ttft_p99_s": 0.2, "e2e_p50_s": 1.0}
        body = {
            "target": name,
            **sampling_header(mode),
            "open_loop": [rate] if open_loop else [],
            "closed_loop": [closed],
        }
        path = tmp_path / f"{name}-{mode}.json"
        path.write_text(json.dumps(body))
        return str(path)

    def draw(prefix: Path, *paths: str) -> int:
        return main(["report", *paths, "--png", str(prefix)])

    prefix = tmp_path / "docs" / "gpu"
    assert draw(prefix, summary("engine", "greedy", True), summary("vllm", "greedy", False)) == 0
    for mode in ("open", "closed"):
        png = Path(f"{prefix}-{mode}-loop.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    assert "gpu-open-loop.png" in capsys.readouterr().out
    # only closed loops: the open-loop plot is not drawn
    only_closed = tmp_path / "closed"
    assert draw(only_closed, summary("engine", "greedy", False)) == 0
    assert Path(f"{only_closed}-closed-loop.png").exists()
    assert not Path(f"{only_closed}-open-loop.png").exists()
    with pytest.raises(SystemExit) as refused:
        draw(prefix, summary("engine", "greedy", False), summary("engine", "text", False))
    assert refused.value.code == 2 and "differ in workload" in capsys.readouterr().err

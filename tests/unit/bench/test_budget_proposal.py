"""bench budgets: the budgets a lease's figures support, by the rule the budget file states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import main
from bench.budget_proposal import propose_budgets
from bench.budgets import Budget, load_budgets
from bench.trials import sampling_header

BUDGETS = """
[vllm]
capacity_req_s = 0.90
offline_output_tok_s = 0.97
[vllm.output_tok_s]
8 = 1.02
32 = 1.50
[vllm.ttft_p50_s]
4 = 0.50
[vllm.tpot_p50_s]
4 = 1.16
[vllm.text.output_tok_s]
8 = 1.0
"""


def spread(field: str, median: float, low: float, high: float) -> dict[str, float]:
    return {field: median, f"{field}_min": low, f"{field}_max": high}


def summary(target: str, mode: str = "greedy", **figures: Any) -> dict[str, Any]:
    return {"target": target, **sampling_header(mode), "trials": 3, **figures}


def engine_and_vllm() -> tuple[dict[str, Any], dict[str, Any]]:
    engine = summary(
        "engine",
        **spread("capacity_req_s", 100.0, 98.0, 101.0),
        open_loop=[
            {
                "rate": 4.0,
                **spread("ttft_p50_s", 0.020, 0.019, 0.022),
                **spread("tpot_p50_s", 0.002, 0.0019, 0.0021),
            },
            {"rate": 96.0, "ttft_p50_s": 0.5, "tpot_p50_s": 0.01},  # past 0.8 x capacity: not budgeted
        ],
        closed_loop=[
            {"concurrency": 8, **spread("output_tok_s", 3000.0, 2900.0, 3100.0)},
            {"concurrency": 32, **spread("output_tok_s", 8000.0, 7800.0, 8100.0)},
            {"concurrency": 64, **spread("output_tok_s", 9000.0, 8900.0, 9100.0)},  # vLLM lacks it
        ],
        offline={"all": {"output_tok_s": 17000.0}},
    )
    vllm = summary(
        "vllm",
        **spread("capacity_req_s", 60.0, 58.0, 64.0),
        open_loop=[
            {
                "rate": 4.0,
                **spread("ttft_p50_s", 0.040, 0.038, 0.041),
                **spread("tpot_p50_s", 0.0021, 0.002, 0.0022),
            },
            {"rate": 96.0, "ttft_p50_s": 1.0, "tpot_p50_s": 0.02},
        ],
        closed_loop=[
            {"concurrency": 8, **spread("output_tok_s", 2000.0, 1900.0, 2200.0)},
            {"concurrency": 32, **spread("output_tok_s", 6000.0, 5800.0, 6200.0)},
        ],
        offline={"all": {"output_tok_s": 13000.0}},
    )
    return engine, vllm


@pytest.fixture
def budgets_file(tmp_path: Path) -> Path:
    path = tmp_path / "budgets.toml"
    path.write_text(BUDGETS)
    return path


def test_each_shared_figure_gets_its_least_favourable_pairing_and_a_budget_past_it(budgets_file):
    engine, vllm = engine_and_vllm()
    proposals = {
        (p.level, p.metric): p for p in propose_budgets(engine, vllm, load_budgets(budgets_file), 1.3)
    }
    assert set(proposals) == {
        ("sweep", "capacity_req_s"),
        ("rate 4/s", "ttft_p50_s"),
        ("rate 4/s", "tpot_p50_s"),
        ("concurrency 8", "output_tok_s"),
        ("concurrency 32", "output_tok_s"),
        ("offline all", "offline_output_tok_s"),
    }  # not rate 96 (past 0.8 x the engine's capacity), not concurrency 64 (vLLM lacks it)

    capacity = proposals["sweep", "capacity_req_s"]
    assert capacity.worst_ratio == pytest.approx(98.0 / 64.0)  # the engine's lowest against vLLM's highest
    assert capacity.proposed == 1.17  # 1.531 / 1.3 = 1.178, rounded down
    assert capacity.action == "raise to 1.17"

    eight = proposals["concurrency 8", "output_tok_s"]
    assert eight.ratio == 1.5 and eight.worst_ratio == pytest.approx(2900.0 / 2200.0)
    assert eight.proposed == 1.01 and eight.current == 1.02 and eight.action == "keep"

    # the medians already miss the budget in force: said, not hidden behind a proposal
    assert proposals["concurrency 32", "output_tok_s"].action.startswith("FAILS now (1.333x vs 1.5)")

    ttft = proposals["rate 4/s", "ttft_p50_s"]  # latency: the engine's slowest against vLLM's quickest
    assert ttft.worst_ratio == pytest.approx(0.022 / 0.038)
    assert ttft.proposed == 0.76  # 0.5789 x 1.3 = 0.7526, rounded up
    assert ttft.action == "keep"  # the medians' 0.5x holds the 0.5 in force, which is stricter than 0.76
    tpot = proposals["rate 4/s", "tpot_p50_s"]
    assert tpot.proposed == 1.37 and tpot.action == "keep"  # 0.0021 / 0.002 x 1.3 = 1.365

    offline = proposals["offline all", "offline_output_tok_s"]  # one trial a side: the figures themselves
    assert offline.worst_ratio == pytest.approx(17000.0 / 13000.0) and offline.action == "raise to 1"


def test_a_latency_budget_tightens_and_a_figure_without_one_is_named(budgets_file):
    engine, vllm = engine_and_vllm()
    budgets = load_budgets(budgets_file)
    budgets["vllm"]["ttft_p50_s"]["4"] = Budget("ttft_p50_s", 0.9, level="4")
    del budgets["vllm"]["tpot_p50_s"]
    proposals = {(p.level, p.metric): p for p in propose_budgets(engine, vllm, budgets, 1.3)}
    assert proposals["rate 4/s", "ttft_p50_s"].action == "tighten to 0.76"
    assert proposals["rate 4/s", "tpot_p50_s"].action == "no budget: add 1.37"


def test_modes_are_read_against_their_own_section_and_never_mixed(budgets_file):
    level = {"concurrency": 8, "output_tok_s": 1500.0}
    text_engine = summary("engine", "text", closed_loop=[level])
    text_vllm = summary("vllm", "text", closed_loop=[dict(level, output_tok_s=1000.0)])
    (proposal,) = propose_budgets(text_engine, text_vllm, load_budgets(budgets_file), 1.3)
    assert proposal.current == 1.0 and proposal.action == "raise to 1.15"
    # a ratio that lands on a hundredth in decimal stays there (float products would nudge it off)
    exact = summary("engine", "text", closed_loop=[dict(level, output_tok_s=741.0)])  # 0.741 / 1.3 = 0.57
    (on_the_mark,) = propose_budgets(exact, text_vllm, load_budgets(budgets_file), 1.3)
    assert on_the_mark.proposed == 0.57
    with pytest.raises(ValueError, match="differ in mode"):
        propose_budgets(text_engine, summary("vllm", closed_loop=[level]), load_budgets(budgets_file), 1.3)
    with pytest.raises(ValueError, match="margin under 1"):
        propose_budgets(text_engine, text_vllm, load_budgets(budgets_file), 0.9)


def test_the_command_prints_the_table_and_refuses_summaries_with_nothing_in_common(
    budgets_file, tmp_path, capsys
):
    engine, vllm = engine_and_vllm()
    paths = []
    for name, body in (("engine", engine), ("vllm", vllm)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(body))
    assert main(["budgets", *map(str, paths), "--budgets", str(budgets_file)]) == 0
    out = capsys.readouterr().out
    assert "raise to 1.17" in out and "least favourable pairing / 1.3" in out
    lonely = tmp_path / "lonely.json"
    lonely.write_text(json.dumps(summary("vllm", closed_loop=[{"concurrency": 2, "output_tok_s": 1.0}])))
    with pytest.raises(SystemExit) as refused:
        main(["budgets", str(paths[0]), str(lonely), "--budgets", str(budgets_file)])
    assert refused.value.code == 2 and "share no budgeted figure" in capsys.readouterr().err

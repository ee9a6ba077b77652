"""`bench compare`'s noise rule on synthetic trial data: a row regresses only when its worsening is past
its --max-drop limit and past the noise band, spread(base) + spread(new), spread = (max − min) / median.
"""

import json
import statistics

import pytest

from bench.__main__ import main
from bench.compare import compare_results, parse_max_drop
from bench.results import Result

LIMITS = "capacity_req_s=3%,served_req_s=3%,output_tok_s=3%,ttft_p50_s=10%"
MACHINE = {"gpu": "NVIDIA H200", "gpu_driver": "570.1", "cpu_model": "AMD EPYC 9654", "cpu_count": 32}


def folded(key, trials):
    """{key: median, key_min, key_max} as the perf tier writes them."""
    return {key: statistics.median(trials), f"{key}_min": min(trials), f"{key}_max": max(trials)}


def scaled(trials, factor):
    return [value * factor for value in trials]


def summary(capacity, ttft=(0.10, 0.10, 0.10), output=(1000.0, 1000.0, 1000.0), hostname="gpu-1"):
    """A perf-tier summary JSON: every figure the median over the given trials, with min and max."""
    return {
        "target": "engine",
        "trials": len(capacity),
        "machine": {**MACHINE, "hostname": hostname},
        **folded("capacity_req_s", capacity),
        "capacity_still_rising": False,
        "open_loop": [{"rate": 4.0, "trials": len(ttft), **folded("ttft_p50_s", ttft)}],
        "closed_loop": [{"concurrency": 8, "trials": len(output), **folded("output_tok_s", output)}],
    }


def write(tmp_path, name, data):
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    return path


def compare(tmp_path, base, new, limits=LIMITS):
    return compare_results(write(tmp_path, "base", base), write(tmp_path, "new", new), parse_max_drop(limits))


def row(comparison, metric):
    (found,) = [r for r in comparison.rows if r.metric == metric]
    return found


TIGHT = [100.0, 99.0, 101.0]  # median 100, spread 2 %
WIDE = [100.0, 96.0, 104.0]  # median 100, spread 8 %


def test_a_5_percent_loss_past_a_1_percent_spread_is_a_regression(tmp_path):
    # base 99..101 (2 %), new 94.05..95.95 (2 %): band 4 %, worsening 5 % > 3 % limit and > 4 %
    comparison = compare(tmp_path, summary(TIGHT), summary(scaled(TIGHT, 0.95)))
    capacity = row(comparison, "capacity_req_s")
    assert capacity.noise_pct == pytest.approx(4.0)
    assert capacity.regressed and not capacity.within_noise
    assert [r.metric for r in comparison.regressions] == ["capacity_req_s"]
    assert "±4.0%" in comparison.table() and "REGRESSION" in comparison.table()


def test_a_1_percent_loss_is_not_a_regression(tmp_path):
    comparison = compare(tmp_path, summary(TIGHT), summary(scaled(TIGHT, 0.99)))
    capacity = row(comparison, "capacity_req_s")
    assert not capacity.regressed and not capacity.within_noise
    assert comparison.regressions == [] and comparison.table().endswith("no regressions")


def test_a_5_percent_loss_inside_an_8_percent_spread_is_within_noise(tmp_path):
    # band 8 % + 8 % = 16 %: a 5 % loss is past the 3 % limit, but two such ranges overlap
    comparison = compare(tmp_path, summary(WIDE), summary(scaled(WIDE, 0.95)))
    capacity = row(comparison, "capacity_req_s")
    assert capacity.noise_pct == pytest.approx(16.0)
    assert capacity.within_noise and not capacity.regressed
    table = comparison.table()
    assert "within noise" in table and "REGRESSION" not in table
    assert table.endswith("no regressions; 1 past the limits but within noise")


def test_a_loss_larger_than_the_band_is_a_regression_even_when_noisy(tmp_path):
    comparison = compare(tmp_path, summary(WIDE), summary(scaled(WIDE, 0.80)))
    assert [r.metric for r in comparison.regressions] == ["capacity_req_s"]  # 20 % > 8 % + 8 %


def test_the_band_adds_both_sides(tmp_path):
    # base spread 2 %, new spread 8 %: a 5 % loss is inside the 10 % band; base alone would not hide it
    comparison = compare(tmp_path, summary(TIGHT), summary(scaled(WIDE, 0.95)))
    capacity = row(comparison, "capacity_req_s")
    assert capacity.noise_pct == pytest.approx(10.0)
    assert capacity.within_noise


@pytest.mark.parametrize(
    ("base", "factor", "regressed", "within_noise"),
    [
        ([0.100, 0.099, 0.101], 1.15, True, False),  # 15 % slower: past 10 % and past the 4 % band
        ([0.100, 0.099, 0.101], 1.05, False, False),  # inside the 10 % limit
        ([0.100, 0.099, 0.101], 0.80, False, False),  # faster is never a regression
        ([0.100, 0.090, 0.110], 1.15, False, True),  # 15 % slower, but the band is 20 % + 20 %
    ],
)
def test_lower_is_better_the_right_way_round(tmp_path, base, factor, regressed, within_noise):
    comparison = compare(tmp_path, summary(TIGHT, ttft=base), summary(TIGHT, ttft=scaled(base, factor)))
    ttft = row(comparison, "ttft_p50_s")
    assert (ttft.regressed, ttft.within_noise) == (regressed, within_noise)


def test_levels_carry_their_own_spread(tmp_path):
    # closed-loop output tokens/s: 5 % lower with 1 % spreads is a regression at that level
    output = [1000.0, 995.0, 1005.0]
    comparison = compare(tmp_path, summary(TIGHT, output=output), summary(TIGHT, output=scaled(output, 0.95)))
    assert [(r.level, r.metric) for r in comparison.regressions] == [("concurrency 8", "output_tok_s")]
    assert row(comparison, "output_tok_s").noise_pct == pytest.approx(2.0)


def test_single_trials_keep_the_plain_rule(tmp_path):
    # one trial: min = max = median, so no band; a 5 % loss past 3 % regresses as before
    comparison = compare(tmp_path, summary([100.0]), summary([95.0]))
    capacity = row(comparison, "capacity_req_s")
    assert capacity.noise_pct == 0 and capacity.regressed


def test_trials_1_ignores_min_and_max(tmp_path):
    base, new = summary(WIDE), summary(scaled(WIDE, 0.95))
    base["trials"] = new["trials"] = 1
    assert row(compare(tmp_path, base, new), "capacity_req_s").regressed


@pytest.mark.parametrize(("factor", "regressed"), [(0.95, True), (0.99, False)])
def test_results_without_spreads_keep_the_plain_rule(factor, regressed):
    level = {"mode": "closed", "concurrency": 8, "output_tok_s": 1000.0, "ttft_p50_s": 0.1}
    base = Result("ours", "base", [level], capacity_req_s=10.0)
    new = Result("ours", "new", [{**level, "output_tok_s": 1000.0 * factor}], capacity_req_s=10.0 * factor)
    comparison = compare_results(base, new, parse_max_drop(LIMITS))
    assert all(r.noise_pct == 0 for r in comparison.rows)
    assert {r.metric for r in comparison.regressions} == (
        {"capacity_req_s", "output_tok_s"} if regressed else set()
    )
    assert "±" not in comparison.table()


def test_the_table_shows_each_figure_with_its_range(tmp_path):
    table = compare(tmp_path, summary(TIGHT), summary(TIGHT)).table()
    assert "100 [99, 101]" in table
    assert table.splitlines()[0].split()[:4] == ["level", "metric", "engine", "(base)"]


def test_markdown(tmp_path):
    comparison = compare(tmp_path, summary(TIGHT), summary(scaled(TIGHT, 0.95)))
    text = comparison.markdown()
    lines = text.splitlines()
    assert "**1 regression past the limits and the noise**" in text
    header = next(i for i, line in enumerate(lines) if line.startswith("| level |"))
    assert lines[header + 1].startswith("|---|")
    table = [line for line in lines[header:] if line.startswith("|")]
    assert all(line.count("|") == lines[header].count("|") for line in table)  # one cell per column
    assert any("capacity_req_s" in line and "**REGRESSION**" in line and "±4.0%" in line for line in table)
    assert "machines differ" not in text


def test_machine_note_only_when_machines_differ(tmp_path):
    same = compare(tmp_path, summary(TIGHT), summary(TIGHT))
    assert same.machine_note is None and "note:" not in same.table()
    other = compare(tmp_path, summary(TIGHT), summary(TIGHT, hostname="gpu-2"))
    assert other.machine_note is not None
    assert "base measured on gpu-1/NVIDIA H200/AMD EPYC 9654/32 cpus" in other.machine_note
    assert "new on gpu-2/" in other.machine_note and "machines differ" in other.machine_note
    assert other.machine_note in other.table() and other.machine_note in other.markdown()


def test_machine_note_compares_only_fields_both_sides_have(tmp_path):
    base, new = summary(TIGHT), summary(TIGHT, hostname="gpu-2")
    del new["machine"]["hostname"]  # the rest agrees
    new["machine"]["gpu_driver"] = "575.0"  # not one of the compared fields
    assert compare(tmp_path, base, new).machine_note is None
    del new["machine"]
    assert compare(tmp_path, base, new).machine_note is None


@pytest.mark.parametrize(("factor", "code"), [(0.95, 1), (0.99, 0)])
def test_cli_exit_code(tmp_path, capsys, factor, code):
    base = write(tmp_path, "base", summary(TIGHT))
    new = write(tmp_path, "new", summary(scaled(TIGHT, factor)))
    assert main(["compare", str(base), str(new), "--max-drop", LIMITS]) == code
    assert ("REGRESSION" in capsys.readouterr().out) == bool(code)
    assert main(["compare", str(base), str(new), "--max-drop", LIMITS, "--format", "markdown"]) == code
    assert capsys.readouterr().out.startswith("### bench compare")


def test_cli_within_noise_exits_0(tmp_path, capsys):
    base = write(tmp_path, "base", summary(WIDE))
    new = write(tmp_path, "new", summary(scaled(WIDE, 0.95)))
    assert main(["compare", str(base), str(new), "--max-drop", LIMITS]) == 0
    assert "within noise" in capsys.readouterr().out


def test_cli_bad_arguments_exit_2(tmp_path):
    base = write(tmp_path, "base", summary(TIGHT))
    for argv in (
        ["compare", str(base), str(tmp_path / "missing.json")],
        ["compare", str(base), str(base), "--format", "html"],
    ):
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2

"""scripts/fidelity.sh and its summary (`python -m bench fidelity-summary`): alternating runs of bench
and `vllm bench serve` against one server, read into one JSON of per-run figures, medians and the gap."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.fake_server import FakeServerConfig, FakeServerProcess
from bench.fidelity import Run, bench_figures, gap_pct, summarize_runs, vllm_figures
from bench.launch import VLLM_ENV_VARIABLE
from bench.metrics import RequestRow, summarize
from bench.results import write_run

REPO = Path(__file__).resolve().parents[3]


def bench_run(folder: Path, tok_per_request: int, duration_s: float, requests: int = 4) -> Path:
    """A `bench run` folder of one closed level: `requests` requests back to back over `duration_s`."""
    rows = []
    for index in range(requests):
        row = RequestRow("t", "closed", None, 2, 0, index, False, 1024, tok_per_request, 0.0, 0.0)
        row.first_token_s, row.done_s = 0.1, duration_s
        row.output_tokens = row.chunks = tok_per_request
        row.usage_prompt_tokens = 1024
        row.itls_s = [0.003] * (tok_per_request - 1)
        rows.append(row)
    level = {"mode": "closed", "rate": None, "concurrency": 2, **summarize(rows)}
    write_run(folder, {"target": "t", "levels": [level]}, rows)
    return folder


def vllm_result(path: Path, output_throughput: float) -> Path:
    path.write_text(
        json.dumps(
            {
                "duration": 2.0,
                "completed": 4,
                "failed": 0,
                "total_input_tokens": 4 * 1020,
                "total_output_tokens": 512,
                "request_throughput": 2.0,
                "output_throughput": output_throughput,
                "median_ttft_ms": 100.0,
                "p99_ttft_ms": 150.0,
                "median_tpot_ms": 3.0,
                "median_itl_ms": 2.9,
                "median_e2el_ms": 500.0,
            }
        )
    )
    return path


class TestSummary:
    def test_vllm_figures_are_read_in_benchs_keys_and_seconds(self, tmp_path):
        figures = vllm_figures(vllm_result(tmp_path / "v.json", 256.0))
        assert figures["output_tok_s"] == 256.0 and figures["served_req_s"] == 2.0
        assert figures["ttft_p50_s"] == pytest.approx(0.1) and figures["ttft_p99_s"] == pytest.approx(0.15)
        assert figures["tpot_p50_s"] == pytest.approx(0.003) and figures["itl_p50_s"] == pytest.approx(0.0029)
        assert figures["prompt_tokens_mean"] == 1020 and figures["output_tokens"] == 512

    def test_bench_figures_come_from_the_level_and_the_rows(self, tmp_path):
        figures = bench_figures(bench_run(tmp_path / "b", 128, 2.0))
        assert figures["output_tok_s"] == pytest.approx(4 * 128 / 2.0)
        assert figures["output_tokens"] == 512 and figures["prompt_tokens_mean"] == 1024
        assert figures["completed"] == 4 and figures["failures"] == 0

    def test_medians_and_gap_in_run_order(self, tmp_path):
        # bench 256, 250, 260 tok/s (median 256); vLLM 250, 262, 261 (median 261): -1.9 %, within 2 %.
        runs = []
        for number, (bench_duration, vllm_tok_s) in enumerate(
            [(2.0, 250.0), (2.048, 262.0), (512 / 260, 261.0)], start=1
        ):
            runs.append(Run("bench", str(bench_run(tmp_path / f"{number}-bench", 128, bench_duration))))
            runs.append(Run("vllm", str(vllm_result(tmp_path / f"{number}-vllm.json", vllm_tok_s))))
        summary = summarize_runs(runs, tolerance_pct=2.0, commands={"bench": "b", "vllm": "v"}, label="x")
        assert [run["client"] for run in summary["runs"]] == ["bench", "vllm"] * 3
        assert [run["order"] for run in summary["runs"]] == [1, 2, 3, 4, 5, 6]
        assert summary["medians"]["bench"]["output_tok_s"] == pytest.approx(256.0)
        assert summary["medians"]["vllm"]["output_tok_s"] == 261.0
        assert summary["gap_pct"]["output_tok_s"] == pytest.approx((256 - 261) / 261 * 100)
        assert summary["agree"] is True
        assert not summarize_runs(runs, tolerance_pct=1.5)["agree"]
        assert summary["commands"] == {"bench": "b", "vllm": "v"} and summary["label"] == "x"

    def test_one_client_alone_is_not_compared(self, tmp_path):
        summary = summarize_runs([Run("bench", str(bench_run(tmp_path / "b", 16, 1.0)))])
        assert summary["agree"] is None and summary["gap_pct"] == {} and "vllm" not in summary["medians"]

    def test_gap_pct(self):
        assert gap_pct(98.0, 100.0) == pytest.approx(-2.0)
        assert math.isnan(gap_pct(1.0, 0.0)) and math.isnan(gap_pct(math.nan, 1.0))

    def test_cli_exit_status_says_whether_they_agree(self, tmp_path, capsys):
        bench = bench_run(tmp_path / "b", 128, 2.0)  # 256 tok/s
        close, far = vllm_result(tmp_path / "close.json", 260.0), vllm_result(tmp_path / "far.json", 280.0)
        out = tmp_path / "f.json"
        assert main(["fidelity-summary", f"bench={bench}", f"vllm={close}", "--out", str(out)]) == 0
        assert json.loads(out.read_text())["agree"] is True
        assert main(["fidelity-summary", f"bench={bench}", f"vllm={far}", "--out", str(out)]) == 1
        assert main(["fidelity-summary", f"bench={bench}", "--out", str(out)]) == 3
        assert "not compared" in capsys.readouterr().out
        with pytest.raises(SystemExit) as bad:
            main(["fidelity-summary", f"other={bench}", "--out", str(out)])
        assert bad.value.code == 2


STUB_VLLM_MAIN = """
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
assert args[:2] == ["bench", "serve"], args
value = lambda flag: args[args.index(flag) + 1]
assert os.environ.get("STAGED_SITE_SOURCED") == "1", "the env file was not sourced"
for flag in ("--ignore-eos", "--temperature", "--max-concurrency", "--random-input-len"):
    assert flag in args, flag
result = {"duration": 1.0, "completed": int(value("--num-prompts")), "failed": 0,
          "total_input_tokens": int(value("--num-prompts")) * int(value("--random-input-len")),
          "total_output_tokens": 100, "request_throughput": 1.0, "output_throughput": 100.0,
          "median_ttft_ms": 10.0, "p99_ttft_ms": 20.0, "median_tpot_ms": 1.0, "median_itl_ms": 1.0,
          "median_e2el_ms": 30.0}
Path(value("--result-dir"), value("--result-filename")).write_text(json.dumps(result))
"""


def staged_stub(tmp_path: Path) -> Path:
    """An env file like a staged vLLM's, whose site holds a stand-in `vllm` CLI that records a result."""
    site = tmp_path / "site"
    for package in ("vllm", "vllm/benchmarks", "vllm/entrypoints", "vllm/entrypoints/cli"):
        (site / package).mkdir(parents=True, exist_ok=True)
        (site / package / "__init__.py").write_text("")
    (site / "vllm/benchmarks/serve.py").write_text("")
    (site / "vllm/entrypoints/cli/main.py").write_text(STUB_VLLM_MAIN)
    env = tmp_path / "env.sh"
    env.write_text(f"export PYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}}\nexport STAGED_SITE_SOURCED=1\n")
    return env


def fidelity_script(model: Path, out: Path, base_url: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != VLLM_ENV_VARIABLE}
    small = {"RUNS": "2", "N_REQUESTS": "6", "CONCURRENCY": "2", "INPUT_LEN": "8", "OUTPUT_LEN": "4"}
    return subprocess.run(
        ["bash", "scripts/fidelity.sh", str(model), str(out), base_url],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**base, **small, "WARMUP_REQUESTS": "2", **env},
        timeout=300,
    )


@pytest.fixture(scope="module")
def fake_url():
    with FakeServerProcess(FakeServerConfig(ttft_s=0.005, itl_s=0.002)) as fake:
        yield fake.base_url


@pytest.fixture
def model_folder(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return tmp_path / "model"


def vllm_importable() -> bool:
    return (
        subprocess.run([sys.executable, "-c", "import vllm.benchmarks.serve"], capture_output=True).returncode
        == 0
    )


@pytest.mark.skipif(vllm_importable(), reason="vLLM is installed here: it would run")
def test_script_without_vllm_runs_bench_alone_and_says_so(fake_url, model_folder, tmp_path):
    done = fidelity_script(model_folder, tmp_path / "out", fake_url)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "== vllm bench serve: not run: vLLM is not installed here" in done.stdout
    summary = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert [run["client"] for run in summary["runs"]] == ["bench", "bench"]
    assert summary["agree"] is None and summary["medians"]["bench"]["completed"] == 6
    assert (tmp_path / "out" / "warmup" / "run.json").exists()


def test_script_alternates_the_clients_with_the_env_file_sourced_for_vllm_only(
    fake_url, model_folder, tmp_path
):
    env = staged_stub(tmp_path)
    done = fidelity_script(model_folder, tmp_path / "out", fake_url, **{VLLM_ENV_VARIABLE: str(env)})
    summary = json.loads((tmp_path / "out" / "fidelity.json").read_text())
    assert done.returncode == {True: 0, False: 1}[summary["agree"]], done.stdout + done.stderr
    assert [run["client"] for run in summary["runs"]] == ["bench", "vllm", "bench", "vllm"]
    assert summary["medians"]["vllm"]["output_tok_s"] == 100.0
    assert summary["medians"]["bench"]["completed"] == 6
    assert summary["commands"]["vllm"].startswith(f"source {env} && python3 -m vllm.entrypoints.cli.main")
    assert "--workload fixed" in summary["commands"]["bench"] and "source" not in summary["commands"]["bench"]


def test_script_refuses_a_url_where_no_server_answers(model_folder, tmp_path):
    done = fidelity_script(model_folder, tmp_path / "out", "http://127.0.0.1:9/v1")
    assert done.returncode == 2 and "no server answers" in done.stderr

"""`python -m bench run|report|compare` end to end, and compare's reading of both result formats."""

import argparse
import copy
import csv
import http.server
import json
import socket
import subprocess
import sys
import threading

import pytest

from bench.__main__ import build_parser, main
from bench.compare import compare_results, parse_max_drop
from bench.fake_server import FakeServerConfig, FakeServerProcess
from bench.metrics import LOWER_IS_BETTER
from bench.results import load_result, read_rows

RUN_KEYS = {"target", "model", "config", "server", "rtt", "stream_check", "levels", "warnings", "started_at"}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """One small run with both an open-loop and a closed-loop level, through the CLI."""
    out = tmp_path_factory.mktemp("runs") / "fake"
    with FakeServerProcess(FakeServerConfig(ttft_s=0.02, itl_s=0.002, slots=8)) as fake:
        argv = ["run", "--base-url", fake.base_url, "--workload", "fixed", "--input-len", "8"]
        argv += ["--output-len", "16", "--rates", "40", "--concurrency", "4", "--n-requests", "12"]
        argv += ["--warmup", "2", "--quiet", "--out", str(out)]
        assert main(argv) == 0
    return out


def test_run_writes_the_run_folder(run_dir):
    run = json.loads((run_dir / "run.json").read_text())
    assert set(run) >= RUN_KEYS
    assert run["model"] == "fake-model"  # the first id of /v1/models
    assert run["target"] == "fake-server"  # /version's name
    assert run["server"]["body"]["name"] == "fake-server"
    assert run["stream_check"]["verdict"] == "streaming"
    assert run["rtt"]["rtt_min_s"] > 0
    assert "api_key" not in run["config"]["endpoint"]
    open_level, closed_level = run["levels"]
    assert (open_level["mode"], open_level["rate"]) == ("open", 40.0)
    assert (closed_level["mode"], closed_level["concurrency"]) == ("closed", 4)
    for level in run["levels"]:
        assert level["completed"] == 12 and level["failures"] == 0
        for key in (
            "served_req_s",
            "output_tok_s",
            "goodput_req_s",
            "ttft_p99_s",
            "itl_p50_s",
            "tpot_mean_s",
        ):
            assert level[key] > 0
        assert {"send_lag_p99_s", "client_loop_lag_p99_s", "client_loop_stall_s", "client_cpu_util"} <= set(
            level
        )

    with (run_dir / "requests.csv").open() as handle:
        records = list(csv.DictReader(handle))
    assert len(records) == 2 * 14
    required = {"target", "mode", "rate", "concurrency", "seed", "prompt_len", "max_tokens", "scheduled_s"}
    required |= {
        "sent_s",
        "first_token_s",
        "done_s",
        "output_tokens",
        "itl_mean_s",
        "itl_max_s",
        "status",
        "error",
    }
    assert required <= set(records[0])
    rows = read_rows(run_dir)
    assert all(row.ok and row.output_tokens == 16 for row in rows)
    assert sum(row.warmup for row in rows) == 4


def test_report_renders_targets_side_by_side(run_dir, tmp_path):
    out = tmp_path / "report.html"
    assert main(["report", str(run_dir), str(run_dir / "run.json"), "--out", str(out)]) == 0
    page = out.read_text()
    assert page.count("data:image/png;base64,") == 2  # open-loop and closed-loop figures
    assert page.count("fake-server (") >= 2  # the same target twice gets told apart
    assert "<table" in page and "<script" not in page and "src='http" not in page  # self-contained


def test_compare_same_run_passes(run_dir, capsys):
    assert main(["compare", str(run_dir), str(run_dir / "run.json")]) == 0
    out = capsys.readouterr().out
    assert "no regressions" in out and "rate 40/s" in out and "concurrency 4" in out


def _write_run(path, run):
    path.mkdir()
    (path / "run.json").write_text(json.dumps(run))
    return path


@pytest.mark.parametrize(
    ("metric", "factor", "regressed"),
    [
        ("served_req_s", 0.9, True),  # higher is better: 10 % lower is past 5 %
        ("served_req_s", 0.97, False),
        ("served_req_s", 1.5, False),
        ("ttft_p50_s", 1.2, True),  # lower is better: 20 % higher is past 10 %
        ("ttft_p50_s", 0.5, False),
        ("output_tok_s", 0.5, True),
    ],
)
def test_compare_reads_directions(run_dir, tmp_path, capsys, metric, factor, regressed):
    run = json.loads((run_dir / "run.json").read_text())
    worse = copy.deepcopy(run)
    for level in worse["levels"]:
        level[metric] *= factor
    new = _write_run(tmp_path / "new", worse)
    assert main(["compare", str(run_dir), str(new)]) == (1 if regressed else 0)
    assert ("REGRESSION" in capsys.readouterr().out) == regressed
    comparison = compare_results(run_dir, new)
    assert {row.metric for row in comparison.regressions} == ({metric} if regressed else set())
    assert len(comparison.regressions) == (2 if regressed else 0)  # both levels


def summary_json(served, ttft, capacity):
    return {
        "target": "ours",
        "version": "0.1.0",
        "gpu": "H100",
        "model": "m",
        "dtype": "bfloat16",
        "workload": "seed-mix",
        "machine": {},
        "server_args": [],
        "trials": 3,
        "capacity_req_s": capacity,
        "capacity_still_rising": False,
        "open_loop": [
            {
                "rate": 2,
                "served_req_s": served,
                "served_req_s_min": 1.0,
                "served_req_s_max": 3.0,
                "ttft_p50_s": ttft,
                "ttft_p99_s": 0.2,
                "itl_p50_s": 0.01,
                "tpot_p50_s": 0.01,
                "e2e_p50_s": 1.0,
                "e2e_p99_s": 2.0,
                "failures": 0,
            },
        ],  # fmt: skip
        "closed_loop": [
            {
                "concurrency": 8,
                "output_tok_s": 500.0,
                "ttft_p50_s": ttft,
                "itl_p50_s": 0.01,
                "tpot_p50_s": 0.01,
            }
        ],
    }


def test_compare_reads_the_perf_summary(tmp_path):
    base, new = tmp_path / "base.json", tmp_path / "new.json"
    base.write_text(json.dumps(summary_json(2.0, 0.1, 10.0)))
    new.write_text(json.dumps(summary_json(2.0, 0.1, 8.0)))
    assert load_result(base).levels[0]["mode"] == "open"
    comparison = compare_results(base, new, parse_max_drop("capacity_req_s=5%,ttft_p50_s=10%"))
    assert [(r.level, r.metric) for r in comparison.regressions] == [("sweep", "capacity_req_s")]
    assert not any(row.metric.endswith(("_min", "_max")) for row in comparison.rows)
    levels = {row.level for row in comparison.rows}
    assert levels == {"sweep", "rate 2/s", "concurrency 8"}


def test_report_reads_the_perf_summary(run_dir, tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(summary_json(2.0, 0.1, 10.0)))
    out = tmp_path / "report.html"
    assert main(["report", str(summary), str(run_dir), "--out", str(out)]) == 0
    page = out.read_text()
    assert "ours" in page and "10.00 req/s" in page  # the summary's target and capacity


def test_compare_a_run_with_a_summary(run_dir, tmp_path):
    summary = tmp_path / "summary.json"
    summary.write_text(json.dumps(summary_json(2.0, 0.1, 10.0)))
    comparison = compare_results(run_dir, summary)
    assert comparison.rows == []  # no level in common
    assert len(comparison.unmatched) == 4


@pytest.mark.parametrize("text", ["served_req_s=0.05", "served_req_s=5", "rate=5%", "nonsense=5%"])
def test_max_drop_needs_percent_and_known_metric(text):
    with pytest.raises(ValueError):
        parse_max_drop(text)


def test_max_drop_parses_percent():
    assert parse_max_drop("served_req_s=5%, ttft_p99_s=12.5%") == {"served_req_s": 5.0, "ttft_p99_s": 12.5}
    assert all(key in LOWER_IS_BETTER for key in ("ttft_p99_s", "e2e_p50_s"))


def test_cli_help_and_usage_errors():
    result = subprocess.run([sys.executable, "-m", "bench", "--help"], capture_output=True, text=True)
    assert result.returncode == 0 and "run" in result.stdout and "compare" in result.stdout
    with pytest.raises(SystemExit) as exit_info:
        main(["compare", "a", "b", "--max-drop", "served_req_s=0.05"])
    assert exit_info.value.code == 2


def test_every_subcommand_has_working_help(capsys):
    # a help text with a bare % made argparse fail on `compare --help` and `ab --help`
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert {"compare", "ab", "offline", "host-cost"} <= set(commands.choices)
    for subcommand in commands.choices:
        with pytest.raises(SystemExit) as exit_info:
            main([subcommand, "--help"])
        assert exit_info.value.code == 0, subcommand
        assert f"python -m bench {subcommand}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    assert "capacity_req_s=5%" in capsys.readouterr().out.replace("\n", "").replace(" ", "")


def test_sweep_flags_reach_the_sweep(monkeypatch):
    import bench.__main__ as cli

    seen = {}
    monkeypatch.setattr(cli, "first_model", lambda base_url, api_key=None: "m")
    monkeypatch.setattr(
        cli, "run_benchmark", lambda config: seen.setdefault("config", config) and {"levels": []}
    )
    argv = ["run", "--base-url", "http://127.0.0.1:1/v1", "--target", "x", "--sweep", "--quiet"]
    main([*argv, "--sweep-latency-multiple", "2.5", "--sweep-max-level-s", "30"])
    sweep = seen["config"].sweep
    assert (sweep.latency_multiple, sweep.max_level_s, sweep.start_rate) == (2.5, 30.0, 1.0)


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class _ModelsHandler(http.server.BaseHTTPRequestHandler):
    """GET /v1/models answers what the test set on the server: (status, body)."""

    def do_GET(self):  # noqa: N802 (http.server's name)
        status, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(
    "answer, says",
    [
        (None, "is the server up?"),  # nothing listening
        ((500, '{"error": "boom"}'), "answered 500"),
        ((200, "<html>not json</html>"), "other than JSON"),
        ((200, '{"object": "list", "data": []}'), "lists no model; pass --model"),
    ],
)
def test_a_server_without_a_model_to_read_is_one_line_not_a_traceback(answer, says, capsys):
    # `bench run` without --model asks GET /v1/models; a server that is down or answers nonsense used
    # to end the command in an httpx traceback
    if answer is None:
        base_url = f"http://127.0.0.1:{_closed_port()}/v1"
        assert main(["run", "--base-url", base_url, "--quiet"]) == 2
    else:
        with http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ModelsHandler) as server:
            server.answer = answer
            threading.Thread(target=server.serve_forever, daemon=True).start()
            base_url = f"http://127.0.0.1:{server.server_address[1]}/v1"
            try:
                assert main(["run", "--base-url", base_url, "--quiet"]) == 2
            finally:
                server.shutdown()
    err = capsys.readouterr().err.strip()
    assert err.startswith("bench run: ") and f"{base_url}/models" in err and says in err
    assert "Traceback" not in err and len(err.splitlines()) == 1

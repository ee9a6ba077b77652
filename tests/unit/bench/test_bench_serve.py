"""`python -m bench serve` and the perf tier's `--server-info`: a server started once, measured by
several separate perf runs (one trial each), with the flags it was started with recorded."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from perf_tier_process import run_perf_tier

from bench.launch import MAX_MODEL_LEN, load_server_info, target_args
from bench.server_metrics import FIRST_TOKEN_KEYS, KERNEL_COMPILES_KEY

REPO = Path(__file__).resolve().parents[3]
SERVER_ARG = "--server-arg=--max-num-seqs=8"


def _stop(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)


def run_bench_serve(
    model: Path, log: Path, info: Path, start_timeout_s: int, *extra: str
) -> subprocess.CompletedProcess[str]:
    """`python -m bench serve --target engine` on CPU (float32), from the repository root."""
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "bench",
            "serve",
            "--target",
            "engine",
            "--model",
            str(model),
            "--dtype",
            "float32",
            "--log",
            str(log),
            "--info",
            str(info),
            "--timeout",
            str(start_timeout_s),
            *extra,
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=start_timeout_s + 60,
    )


@pytest.fixture
def served_engine(tiny_model_dir, tmp_path):
    info_path = tmp_path / "engine-server.json"
    # With one more flag of the server's own, passed through as given and recorded.
    done = run_bench_serve(tiny_model_dir, tmp_path / "engine-server.log", info_path, 120, SERVER_ARG)
    assert done.returncode == 0, done.stderr
    info = load_server_info(info_path)
    yield info, info_path, done.stdout
    _stop(int(info["pid"]))


def test_serve_leaves_the_server_running_and_describes_it(served_engine):
    info, _, stdout = served_engine
    # The command has returned; the server it started still answers.
    root = str(info["base_url"]).removesuffix("/v1")
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200
    assert info["args"] == [*target_args("engine", "float32"), "--max-num-seqs=8"]
    assert f"--max-model-len {MAX_MODEL_LEN}" in " ".join(info["args"])
    config = httpx.get(f"{root}/version", timeout=10).json()["config"]
    assert config["max_model_len"] == MAX_MODEL_LEN and config["dtype"] == "float32"
    assert config["max_num_seqs"] == 8
    assert info["ready_after_s"] > 0 and "python -m bench stop --info" in stdout


def live_group_members(pgid: int) -> list[int]:
    """The processes of a process group that are running (not gone, and not zombies waiting for
    whoever inherited them to reap them), read from /proc."""
    live = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone while being read
        state, process_group = fields[0], int(fields[2])
        if process_group == pgid and state != "Z":
            live.append(int(stat.parent.name))
    return live


def run_bench_stop(info_path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "bench", "stop", "--info", str(info_path), "--grace", "30"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=90,
    )


def test_stop_ends_the_served_server_and_its_process_group(served_engine):
    """`bench stop` ends what `bench serve` left running (the API process and its engine core: the
    whole process group), says so, and on a second call says it had already stopped."""
    info, info_path, _ = served_engine
    pid = int(info["pid"])
    done = run_bench_stop(info_path)
    assert done.returncode == 0, done.stderr
    assert "stopped the server" in done.stdout
    assert live_group_members(pid) == []
    root = str(info["base_url"]).removesuffix("/v1")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{root}/health", timeout=5)
    again = run_bench_stop(info_path)
    assert again.returncode == 0 and "had already stopped" in again.stdout


def test_stop_refuses_a_description_without_a_pid(tmp_path):
    info_path = tmp_path / "server.json"
    info_path.write_text(json.dumps({"target": "engine", "base_url": "http://127.0.0.1:1/v1", "args": []}))
    done = run_bench_stop(info_path)
    assert done.returncode == 2 and "no pid" in done.stderr


def test_perf_tier_measures_a_served_server_records_its_flags_and_leaves_it_up(
    served_engine, tiny_model_dir, tmp_path
):
    """The tier measures the server `bench serve` left running and records how it was started. Its
    speed is recorded, not judged: `--model` names the served folder, for which no reference is
    stored, so the case says so and skips its budgets (a figure held to a reference measured on
    another machine would judge that machine's speed, not the server's)."""
    info, info_path, _ = served_engine
    out = tmp_path / "perf-out"
    assert not (REPO / "baselines" / "cpu" / tiny_model_dir.name).exists()
    done = run_perf_tier(
        ["-rs", "--target", "engine", "--server-info", str(info_path), "--model", str(tiny_model_dir)]
        + ["--profile", "smoke", "--trials", "1", "--perf-out", str(out), "-k", "test_closed_loop and 1"],
        timeout_s=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"no baseline for cpu/{tiny_model_dir.name}" in done.stdout, done.stdout[-3000:]
    summary = json.loads((out / "engine-seed-mix.json").read_text())
    assert summary["server_args"] == info["args"]
    assert summary["server_ready_s"] == pytest.approx(info["ready_after_s"])
    assert [level["concurrency"] for level in summary["closed_loop"]] == [1]
    # the server's own figures of the level, as bench's suite records them (bench.server_metrics)
    (level,) = summary["closed_loop"]
    assert level[KERNEL_COMPILES_KEY] == 0  # on CPU nothing compiles
    assert set(FIRST_TOKEN_KEYS) <= set(level)
    # and the client's own load over it: did the client keep up (bench.selfcheck)
    assert level["client_cpu_util"] > 0 and level["client_loop_lag_p99_s"] >= 0
    root = str(info["base_url"]).removesuffix("/v1")
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200, (
        "the perf tier stopped a server it did not start"
    )


def test_server_info_must_match_the_measured_target(tmp_path):
    info_path = tmp_path / "vllm-server.json"
    info_path.write_text(json.dumps({"target": "vllm", "base_url": "http://127.0.0.1:1/v1", "args": []}))
    done = run_perf_tier(
        ["--target", "engine", "--server-info", str(info_path), "--perf-out", str(tmp_path / "out")],
        timeout_s=120,
    )
    assert done.returncode != 0
    assert "--server-info describes ['vllm'], not measured with --target engine" in done.stdout + done.stderr


def test_server_info_refuses_a_file_not_written_by_serve(tmp_path):
    path = tmp_path / "x.json"
    path.write_text(json.dumps({"url": "http://x"}))
    with pytest.raises(ValueError, match="missing"):
        load_server_info(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_server_info(tmp_path / "absent.json")


def test_serve_reports_a_server_that_cannot_start(tmp_path):
    done = run_bench_serve(
        tmp_path / "no-model", tmp_path / "log", tmp_path / "info.json", start_timeout_s=60
    )
    assert done.returncode == 1
    assert "error: engine server exited" in done.stderr
    assert not (tmp_path / "info.json").exists()

"""`bench host-cost --server-info`: any running server's whole process tree, measured under bench's
closed loop, as CPU-seconds per 1,000 output tokens, process by process: here this project's server
(its API process and its engine core) with the tiny model on CPU."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from bench.__main__ import main
from bench.host_cost import ProcessCpu, process_tree, tree_delta
from bench.launch import ServerProcess, ServerSpec

SERVER_START_DEADLINE_S = 120.0  # a deadline against a server that never gets ready, not a speed


@pytest.fixture(scope="module")
def running_server(tiny_model_dir, tmp_path_factory):
    """This project's server on the tiny model, described as `bench serve --info` describes it."""
    folder = tmp_path_factory.mktemp("server")
    spec = ServerSpec.for_target("engine", str(tiny_model_dir), "float32")
    with ServerProcess(spec, folder / "server.log") as process:
        process.start(timeout_s=SERVER_START_DEADLINE_S)
        info = folder / "engine-server.json"
        info.write_text(json.dumps(process.describe()))
        yield info, process


def test_a_running_servers_whole_tree_is_measured_per_1000_tokens(running_server, tmp_path, capsys):
    info, process = running_server
    out = tmp_path / "tree.json"
    argv = ["host-cost", "--server-info", str(info), "--concurrency", "2", "--requests", "4"]
    argv += ["--workers", "2", "--input-len", "16", "--output-len", "24"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    (server,) = report["servers"]
    assert (server["target"], server["completed"], server["failures"]) == ("engine", 4, 0)
    # two client processes shared the streams, and said how loaded each was; neither is the server's
    assert report["config"]["workers"] == 2 and server["client"]["workers"] == 2
    assert server["client"]["client_loop_lag_p99_s"] >= 0 and server["client"]["client_cpu_util"] > 0
    assert server["output_tokens"] == 4 * 24 and server["pid"] == process.process.pid
    # the API process and the engine core's process, each with its own CPU time
    processes = server["processes"]
    assert len(processes) >= 2 and process.process.pid in {entry["pid"] for entry in processes}
    assert sum(entry["cpu_s"] > 0 for entry in processes) >= 2
    assert [entry["cpu_s"] > 0 for entry in processes if entry["name"] == "engine-core"] == [True]
    assert server["server_cpu_s"] == pytest.approx(sum(entry["cpu_s"] for entry in processes))
    assert server["server_cpu_s_per_1000_tokens"] == pytest.approx(server["server_cpu_s"] / 96 * 1000)
    assert "CPU-s per 1,000 output tokens" in capsys.readouterr().out


def test_text_prompts_are_made_with_the_servers_tokenizer(running_server, tmp_path):
    info, _ = running_server
    out = tmp_path / "text.json"
    argv = ["host-cost", "--server-info", str(info), "--prompt-format", "text", "--concurrency", "2"]
    assert main([*argv, "--requests", "2", "--input-len", "40", "--output-len", "8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["config"]["prompt_format"] == "text" and report["servers"][0]["client"]["workers"] == 1
    assert (report["servers"][0]["completed"], report["servers"][0]["output_tokens"]) == (2, 16)


def test_a_server_that_is_not_running_is_refused_by_name(tmp_path, capsys):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    info = tmp_path / "vllm-server.json"
    info.write_text(
        json.dumps({"target": "vllm", "base_url": "http://127.0.0.1:9/v1", "args": [], "pid": gone.pid})
    )
    assert main(["host-cost", "--server-info", str(info)]) == 2
    printed = capsys.readouterr().out
    assert f"the vllm server described (pid {gone.pid}) is not running" in printed


def test_host_cost_needs_a_model_or_a_server(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["host-cost"])
    assert exit_info.value.code == 2 and "--server-info" in capsys.readouterr().err


def test_a_tree_reading_includes_children_and_the_delta_counts_new_processes_from_zero():
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(30)'])",
        ]
    )
    tree: dict[int, ProcessCpu] = {}
    try:
        deadline = time.monotonic() + 30  # a deadline against a child that never starts, not a speed
        while len(tree) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            tree = process_tree(parent.pid)
        assert len(tree) == 2 and parent.pid in tree
        assert all(entry.command.startswith(sys.executable) for entry in tree.values())
    finally:
        for pid in tree:
            if pid != parent.pid:
                os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.wait()
    before = {1: ProcessCpu(1, "a", "a", 1.0), 2: ProcessCpu(2, "gone", "gone", 5.0)}
    after = {1: ProcessCpu(1, "a", "a", 1.5), 3: ProcessCpu(3, "new", "new", 2.0)}
    assert tree_delta(before, after) == [ProcessCpu(3, "new", "new", 2.0), ProcessCpu(1, "a", "a", 0.5)]

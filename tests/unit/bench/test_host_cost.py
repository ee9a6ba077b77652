"""`bench host-cost`: this project's server with the model replaced by a constant token, measured
through bench's client: every request streams all its tokens, and the server's CPU per token and the
HTTP stack it ran on are reported, beside each half alone: the engine's own host work per token (no
server) and the server over an engine that only emits the token."""

from __future__ import annotations

import json
import os

import bench.host_cost
from bench.__main__ import main
from bench.host_cost import CONSTANT_TOKEN, process_cpu_seconds


def test_host_cost_streams_every_token_and_reports_the_servers_cpu(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "host-cost.json"
    # 1,024 tokens: ~25 ms of server CPU, a few of /proc's 10-ms ticks
    argv = ["host-cost", "--model", str(tiny_model_dir), "--concurrency", "4", "--requests", "16"]
    assert main([*argv, "--input-len", "16", "--output-len", "64", "--out", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert (figures["completed"], figures["failures"], figures["output_tokens"]) == (16, 0, 16 * 64)
    assert figures["server_cpu_s"] > 0 and figures["wall_s"] > 0
    assert figures["server_cpu_us_per_token"] == figures["server_cpu_s"] / (16 * 64) * 1e6
    assert 1 <= figures["output_tokens"] / figures["chunks"] <= 64
    assert (figures["http"], figures["event_loop"]) == ("httptools", "uvloop")
    assert figures["config"]["concurrency"] == 4 and figures["machine"]["cpu_count"] == os.cpu_count()
    assert figures["client"]["workers"] == 1 and figures["client"]["client_cpu_util"] > 0
    # the engine's steps alone, the same closed loop without the server: every token, split by phase
    assert figures["engine_output_tokens"] == 16 * 64
    phases = [
        f"engine_{name}_us_per_token" for name in ("schedule", "prepare", "execute", "update", "outputs")
    ]
    assert all(figures[key] > 0 for key in phases)
    assert sum(figures[key] for key in phases) <= figures["engine_us_per_token"]
    # the server over an engine that only emits the token: the HTTP side's cost alone
    assert figures["http_only_us_per_token"] > 0 and figures["http_only_output_tok_s"] > 0
    assert 1 <= figures["http_only_tokens_per_chunk"] <= 64
    assert "ready: serving" in out.with_name("host-cost-http-only.log").read_text()
    printed = capsys.readouterr().out
    assert "us of server CPU a streamed token" in printed and "HTTP httptools" in printed
    assert "engine alone:" in printed and "HTTP side alone" in printed
    # the server's log is kept beside the figures
    assert "ready: serving" in out.with_suffix(".log").read_text()


def test_the_constant_token_is_an_ordinary_token_of_the_tiny_vocabulary(tiny_model_dir):
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert config["vocab_size"] > CONSTANT_TOKEN and config["eos_token_id"] != CONSTANT_TOKEN


def test_process_cpu_seconds_reads_this_process():
    start = process_cpu_seconds(os.getpid())
    sum(i * i for i in range(300_000))
    assert process_cpu_seconds(os.getpid()) > start


def test_without_proc_it_says_so_and_exits_2(tiny_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench.host_cost, "PROC", tmp_path / "no-proc")
    assert main(["host-cost", "--model", str(tiny_model_dir)]) == 2
    assert "Linux only" in capsys.readouterr().out

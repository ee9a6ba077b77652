"""The perf tier's comparisons run with prefix caching off on both sides, as the stored baselines were
measured (the seed-mix repeats its prompts at every level): both servers' flags, both offline targets.

`bench ab` starts the base commit's server with the new commit's flags. A base that predates
`--no-enable-prefix-caching` must still start: ServerProcess, for an engine server run from another
checkout, passes an optional flag only when that server's --help lists it. Two stand-in servers (bench's
fake server behind an argparse that refuses unknown flags, as `python -m server` does): one without the
flag, one with it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.launch import OPTIONAL_ENGINE_FLAGS, ServerProcess, ServerSpec, known_args, target_args
from bench.offline_worker import EngineTarget
from bench.workload import Request

SERVER = '''"""A stand-in for `python -m server`: strict flags, then bench's fake server."""
import argparse

from bench.fake_server import main

parser = argparse.ArgumentParser(prog="python -m server")
for flag in ("--model", "--host", "--port", "--dtype", "--max-model-len", "--seed"):
    parser.add_argument(flag)
{extra}
args = parser.parse_args()
main(["--port", args.port])
'''
WITH_FLAG = 'parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction)'


def checkout(folder: Path, extra: str) -> Path:
    (folder / "server").mkdir(parents=True)
    (folder / "server" / "__main__.py").write_text(SERVER.format(extra=extra))
    return folder


def test_known_args_drops_only_optional_flags_the_help_lacks():
    args = ["--no-enable-prefix-caching", "--dtype", "float32", "--seed", "0"]
    assert known_args(args, "usage: --dtype DTYPE --seed SEED") == args[1:]
    assert known_args(args, "--enable-prefix-caching, --no-enable-prefix-caching") == args
    assert known_args(args, "") == args[1:]  # help unreadable: no optional flag
    assert OPTIONAL_ENGINE_FLAGS == ("--no-enable-prefix-caching",)


@pytest.mark.parametrize("has_flag", [False, True])
def test_a_server_from_another_checkout_starts_with_the_flags_it_knows(tmp_path, has_flag):
    folder = checkout(tmp_path / "worktree", WITH_FLAG if has_flag else "")
    spec = ServerSpec.for_target("engine", "unused", "float32")
    assert "--no-enable-prefix-caching" in spec.args  # the perf tier's engine flags: cache off
    spec.cwd = str(folder)
    if not has_flag:  # started with the flag as given, this server refuses it
        unfiltered = [sys.executable, "-m", "server", *spec.args]
        refused = subprocess.run(unfiltered, cwd=folder, capture_output=True, text=True, timeout=60)
        assert refused.returncode == 2 and "unrecognized arguments" in refused.stderr
    with ServerProcess(spec, tmp_path / "server.log") as process:
        process.start(timeout_s=60)
        assert ("--no-enable-prefix-caching" in spec.args) == has_flag
        assert process.describe()["args"] == spec.args


def test_both_servers_start_without_prefix_caching():
    for target in ("engine", "vllm"):
        assert "--no-enable-prefix-caching" in target_args(target, "bfloat16")


def test_the_offline_engine_target_runs_without_prefix_caching_unless_asked(tiny_model_dir):
    def run_twice(target: EngineTarget) -> dict:
        for request_id in ("a", "b"):  # the same 40-token prompt, one after the other
            target.add(request_id, Request(0, list(range(1000, 1040)), 40, max_tokens=2))
            while target.has_unfinished():
                target.step()
        return target.describe()

    off = run_twice(EngineTarget(str(tiny_model_dir), "float32", 256, 0, {}))
    assert off["config"]["enable_prefix_caching"] is False
    assert off["prefix_cache"] == {"queries": 0, "hits": 0, "hit_rate": None}  # none looked up
    on = run_twice(EngineTarget(str(tiny_model_dir), "float32", 256, 0, {"enable_prefix_caching": True}))
    assert on["config"]["enable_prefix_caching"] is True
    assert on["prefix_cache"] == {"queries": 80, "hits": 32, "hit_rate": 0.4}

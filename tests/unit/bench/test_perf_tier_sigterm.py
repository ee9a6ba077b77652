"""A perf tier run ended by SIGTERM (a CI step's time limit, `timeout(1)`) stops the server it started.

The tier starts each server in a process session of its own (bench.launch.ServerProcess), so a
SIGTERM that ended pytest outright left the server and its engine core running: on a GPU they hold
~90% of its memory, and the next server started there failed to start (vLLM's engine core did, on
the H200). bench.launch.stop_servers_on_sigterm turns SIGTERM into Ctrl-C's KeyboardInterrupt, so
the fixtures' teardowns stop what they started.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from perf_tier_process import REPO, perf_tier_command

from bench.host_cost import child_pids, wait_gone

SERVER_UP_WITHIN_S = 180.0  # the tiny model's server and its engine core on a busy 2-core machine
TIER_EXITS_WITHIN_S = 60.0
GONE_WITHIN_S = 30.0  # deadlines against a hang, not speed figures


def _is_server(pid: int) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return argv[1:3] == [b"-m", b"server"]


def _wait_for_server_and_core(tier: subprocess.Popen[bytes]) -> list[int]:
    """[server, engine core]: the tier's `python -m server` child once it has started its core."""
    deadline = time.monotonic() + SERVER_UP_WITHIN_S
    while time.monotonic() < deadline and tier.poll() is None:
        for pid in filter(_is_server, child_pids(tier.pid)):
            if cores := child_pids(pid):
                return [pid, *cores]
        time.sleep(0.2)
    raise AssertionError(f"no server with an engine core under the tier (exit status {tier.poll()})")


def test_sigterm_stops_the_server_the_tier_started(tiny_model_dir: Path, tmp_path: Path) -> None:
    tier = subprocess.Popen(
        perf_tier_command(
            ["-p", "no:cacheprovider", "--profile", "smoke", "--model", str(tiny_model_dir)]
            + ["-k", "closed_loop and greedy-1", "--perf-out", str(tmp_path)]
        ),
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    started: list[int] = []
    try:
        started = _wait_for_server_and_core(tier)
        tier.send_signal(signal.SIGTERM)
        assert tier.wait(TIER_EXITS_WITHIN_S) != 0  # interrupted, not passed
        assert wait_gone(started, GONE_WITHIN_S) == [], f"left running: {started}"
    finally:
        if tier.poll() is None:
            tier.kill()
            tier.wait()
        for pid in wait_gone(started, 0.0):
            os.kill(pid, signal.SIGKILL)

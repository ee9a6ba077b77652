"""`python -m server --api-server-count 2`: two API processes in front of one engine core.

Both accept on the one port; the admission limit holds over both (the core keeps it); /metrics sums
both processes' counters whichever answers; SIGTERM to the launcher, or to every process of the
server, drains once and exits 0; a dead core fails the requests in flight and takes the server down
(exit 1); a killed launcher leaves no process behind.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from server_testing import ServerProcess, parse_metrics
from test_server_process import CORE_GONE_WITHIN_S, EXITED_WITHIN_S, FAILED_WITHIN_S, stream_lines

from bench.host_cost import wait_gone

TWO = ("--api-server-count", "2")
LONG = {"prompt": [1, 2, 3], "max_tokens": 200, "ignore_eos": True, "stream": True}


def socket_count(pid: int) -> int:
    return sum(1 for fd in Path(f"/proc/{pid}/fd").iterdir() if os.readlink(fd).startswith("socket:"))


def test_both_api_processes_accept_on_the_port(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*TWO)
    api_pids = server.api_pids()
    assert len(api_pids) == 2 and server.core_pid() not in api_pids
    # each names itself, as ps and bench host-cost --server-info show it
    names = {Path(f"/proc/{pid}/comm").read_text().strip() for pid in [*api_pids, server.core_pid()]}
    assert names == {"api-server-0", "api-server-1", "engine-core"}
    before = {pid: socket_count(pid) for pid in api_pids}
    clients: list[httpx.Client] = []
    try:
        # Rounds of 32 connections, each kept open by its client, until both processes hold some (the
        # kernel hands each to whichever process accepts first: one busy process may miss a round).
        for _ in range(3):
            for _ in range(32):
                clients.append(httpx.Client(base_url=server.url, timeout=30))
                assert clients[-1].get("/health").json() == {"status": "ok"}
            gained = {pid: socket_count(pid) - before[pid] for pid in api_pids}
            if all(gained.values()):
                break
    finally:
        for client in clients:
            client.close()
    assert sum(gained.values()) == len(clients) and all(gained.values()), gained


def test_one_limit_and_one_set_of_metrics_over_both(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*TWO, "--max-pending", "2")
    with (
        httpx.Client(base_url=server.url, timeout=60) as first,
        httpx.Client(base_url=server.url, timeout=60) as second,
    ):
        one, one_lines = stream_lines(first, LONG)
        two, two_lines = stream_lines(second, LONG)
        next(one_lines), next(two_lines)  # both admitted and generating
        refusals = []
        for _ in range(6):  # new connections: each lands on either process, and each must refuse
            with httpx.Client(base_url=server.url, timeout=30) as other:
                refusals.append(other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}))
        ends = [list(one_lines)[-2], list(two_lines)[-2]]
        one.close(), two.close()
    for refused in refusals:
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert "pending" in refused.json()["error"]["message"]
    assert [json.loads(end[len("data: ") :])["choices"][0]["finish_reason"] for end in ends] == ["length"] * 2
    for _ in range(6):  # whichever process answers, the sums over both
        with httpx.Client(base_url=server.url, timeout=30) as scraper:
            metrics = parse_metrics(scraper.get("/metrics").text)
        assert metrics['engine_request_success_total{finished_reason="length"}'] == 2
        assert metrics["server_requests_rejected_total"] == 6
        assert metrics["engine_generation_tokens_total"] == 400
        assert metrics["engine_time_to_first_token_seconds_count"] == 2
        assert metrics["server_requests_pending"] == 0 and metrics["engine_kv_blocks_used"] == 0


@pytest.mark.parametrize("whole_group", [False, True], ids=["launcher", "every process"])
def test_sigterm_drains_both_and_exits_0(
    start_server: Callable[..., ServerProcess], whole_group: bool
) -> None:
    server = start_server(*TWO, "--shutdown-timeout", "60")
    pids = [server.process.pid, server.core_pid(), *server.api_pids()]
    with httpx.Client(base_url=server.url, timeout=60) as client:
        response, lines = stream_lines(client, {**LONG, "max_tokens": 60})
        next(lines)
        for pid in pids if whole_group else pids[:1]:
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.3)
        for _ in range(4):  # either process: refusing new requests
            with httpx.Client(base_url=server.url, timeout=30) as other:
                try:
                    refused = other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
                except (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError):
                    # The idle process drains at once and closes its listening socket: a connection the
                    # kernel had queued on that socket is refused or reset, never answered wrongly.
                    continue
                assert refused.status_code == 503
        rest = list(lines)
        response.close()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(EXITED_WITHIN_S) == 0
    assert wait_gone(pids, CORE_GONE_WITHIN_S) == []


def test_a_dead_core_fails_the_requests_and_takes_the_server_down(
    start_server: Callable[..., ServerProcess],
) -> None:
    server = start_server(*TWO)
    core_pid, api_pids = server.core_pid(), server.api_pids()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response, lines = stream_lines(client, {**LONG, "max_tokens": 400})
        next(lines)
        os.kill(core_pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = list(lines)
        failed_s = time.monotonic() - killed
        response.close()
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["type"] == "InternalServerError" and "engine core stopped" in error["message"]
    assert failed_s < FAILED_WITHIN_S, failed_s
    assert server.process.wait(EXITED_WITHIN_S) == 1
    assert wait_gone(api_pids, CORE_GONE_WITHIN_S) == []


def test_a_killed_launcher_leaves_no_process(start_server: Callable[..., ServerProcess]) -> None:
    server = start_server(*TWO)
    pids = [server.core_pid(), *server.api_pids()]
    server.process.kill()
    server.process.wait(10)
    assert wait_gone(pids, CORE_GONE_WITHIN_S) == []

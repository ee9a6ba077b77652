"""`python -m server` as a real subprocess on 127.0.0.1: the CLI flags reach the engine, the ready
line names the port and the HTTP stack (httptools and uvloop, which the server extra installs), and SIGTERM drains (the in-flight request finishes, a new one gets 503, exit 0)
or, past --shutdown-timeout, aborts what is left and still exits 0. The engine core's process: if it
dies, every request in flight fails at once and the server exits 1; a killed server leaves no core; a
SIGTERM to the whole process group still drains.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import time
from collections.abc import Iterator

import httpx

from bench.host_cost import pid_alive


def stream_lines(client: httpx.Client, body: dict) -> tuple[httpx.Response, Iterator[str]]:
    request = client.build_request("POST", "/v1/completions", json=body)
    response = client.send(request, stream=True)
    assert response.status_code == 200
    return response, (line for line in response.iter_lines() if line.startswith("data: "))


def test_sigterm_drains_in_flight_and_refuses_new(start_server) -> None:
    server = start_server("--shutdown-timeout", "30", "--block-size", "16", "--seed", "0")
    with (
        httpx.Client(base_url=server.url, timeout=30) as client,
        httpx.Client(base_url=server.url, timeout=30) as other,
    ):
        assert client.get("/health").json() == {"status": "ok"}
        config = client.get("/version").json()["config"]
        assert (config["max_model_len"], config["num_kv_blocks"], config["block_size"]) == (512, 64, 16)
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        assert "HTTP httptools, event loop uvloop" in server.log_path.read_text()

        body = {"prompt": [1, 2, 3], "max_tokens": 150, "ignore_eos": True, "stream": True}
        response, lines = stream_lines(client, {**body, "stream_options": {"include_usage": True}})
        next(lines)  # generating
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        refused = other.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        assert refused.json()["error"]["type"] == "ServiceUnavailableError"
        rest = list(lines)
        response.close()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-3][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    # every token: the drain let the request finish (events may carry several under load)
    assert json.loads(rest[-2][len("data: ") :])["usage"]["completion_tokens"] == 150
    assert server.process.wait(20) == 0


def test_sigterm_aborts_what_outlives_the_timeout(start_server) -> None:
    server = start_server("--shutdown-timeout", "0.5")
    with httpx.Client(base_url=server.url, timeout=30) as client:
        response, lines = stream_lines(
            client, {"prompt": [1, 2, 3], "max_tokens": 500, "ignore_eos": True, "stream": True}
        )
        next(lines)
        server.process.send_signal(signal.SIGTERM)
        rest = list(lines)
        response.close()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "abort"
    assert len(rest) < 499
    assert server.process.wait(20) == 0
    assert "drain timeout: aborting 1 request(s)" in server.log_path.read_text()


# Deadlines against a hang, not speed targets: what a client and a supervisor may wait for.
FAILED_WITHIN_S = 2.0  # every in-flight request ends with an error after the core dies
EXITED_WITHIN_S = 10.0  # the server process exits, non-zero, after the core dies
CORE_GONE_WITHIN_S = 10.0  # the core exits after its server is killed


def test_a_dead_core_fails_every_request_and_the_server_exits_non_zero(start_server) -> None:
    server = start_server()
    core_pid = server.core_pid()
    with httpx.Client(base_url=server.url, timeout=30) as client:
        long = {"prompt": [1, 2, 3], "max_tokens": 400, "ignore_eos": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            whole = pool.submit(client.post, "/v1/completions", json=long)
            response, lines = stream_lines(client, {**long, "stream": True})
            next(lines)  # generating
            os.kill(core_pid, signal.SIGKILL)
            killed = time.monotonic()
            rest = list(lines)
            streamed_s = time.monotonic() - killed
            answer = whole.result(timeout=30)
            answered_s = time.monotonic() - killed
            response.close()
    assert rest[-1] == "data: [DONE]"
    error = json.loads(rest[-2][len("data: ") :])["error"]
    assert error["type"] == "InternalServerError" and "engine core stopped" in error["message"]
    assert answer.status_code == 500 and "engine core stopped" in answer.json()["error"]["message"]
    assert streamed_s < FAILED_WITHIN_S and answered_s < FAILED_WITHIN_S, (streamed_s, answered_s)
    assert server.process.wait(EXITED_WITHIN_S) == 1
    assert "the engine core stopped" in server.log_path.read_text()
    assert not pid_alive(core_pid)


def test_a_killed_server_leaves_no_core_behind(start_server) -> None:
    server = start_server()
    core_pid = server.core_pid()
    server.process.kill()
    server.process.wait(10)
    deadline = time.monotonic() + CORE_GONE_WITHIN_S
    while pid_alive(core_pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(core_pid)


def test_a_group_sigterm_still_drains(start_server) -> None:
    # systemd and `kill -- -PGID` signal every process of the server: the core must keep stepping
    # while the API process lets the accepted request finish.
    server = start_server("--shutdown-timeout", "60")
    core_pid = server.core_pid()
    with httpx.Client(base_url=server.url, timeout=60) as client:
        body = {"prompt": [1, 2, 3], "max_tokens": 60, "ignore_eos": True, "stream": True}
        response, lines = stream_lines(client, body)
        next(lines)
        for pid in (server.process.pid, core_pid):
            os.kill(pid, signal.SIGTERM)
        rest = list(lines)
        response.close()
    assert rest[-1] == "data: [DONE]"
    assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
    assert server.process.wait(EXITED_WITHIN_S) == 0

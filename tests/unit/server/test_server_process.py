"""`python -m server` as a real subprocess on 127.0.0.1: the CLI flags reach the engine, the ready
line names the port and the HTTP stack (httptools and uvloop, which the server extra installs), and SIGTERM drains (the in-flight request finishes, a new one gets 503, exit 0)
or, past --shutdown-timeout, aborts what is left and still exits 0.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator

import httpx


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

        body = {"prompt": [1, 2, 3], "max_tokens": 300, "ignore_eos": True, "stream": True}
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
    assert json.loads(rest[-2][len("data: ") :])["usage"]["completion_tokens"] == 300
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

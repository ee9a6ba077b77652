"""The API key and the request size limit, against a real `python -m server` process (black box).

The key comes from the environment (so it is not in the process listing); /v1/ routes and
/reset_prefix_cache need it, the operational routes stay open. Oversized bodies get 413 before they are read whole: the tests send
the head of a request and never its end, so only an early answer can reach them.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_testing import ServerProcess

KEY = "sk-test-0123456789abcdef"
MAX_BYTES = 4096
COMPLETION = {"prompt": [1, 2, 3], "max_tokens": 2}


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("guards") / "server.log"
    process = ServerProcess(
        tiny_model_dir, log, "--max-request-bytes", str(MAX_BYTES), env={"PAGED_ENGINE_API_KEY": KEY}
    )
    yield process
    process.close()


def assert_error(response: httpx.Response, status: int, error_type: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["code"] == status and error["message"]


def raw_exchange(url: str, head: bytes, body_parts: list[bytes]) -> bytes:
    """Send a request head and some body bytes, never the rest; return what the server answers."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(head)
        for part in body_parts:
            sock.sendall(part)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer


def test_the_key_stays_out_of_the_process_listing(server: ServerProcess) -> None:
    assert KEY.encode() not in Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert KEY not in server.log_text()


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Bearer {KEY}x"},
        {"Authorization": f"Bearer {KEY[:-1]}"},
        {"Authorization": f"Basic {KEY}"},
        {"Authorization": KEY},
        {"X-API-Key": KEY},
    ],
)
@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/models"),
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/reset_prefix_cache"),
    ],
)
def test_v1_routes_refuse_a_missing_or_wrong_key(
    server: ServerProcess, headers: dict[str, str], method: str, path: str
) -> None:
    response = httpx.request(method, server.url + path, headers=headers, json=COMPLETION, timeout=10)
    assert_error(response, 401, "AuthenticationError")
    assert response.headers["www-authenticate"] == "Bearer"


def test_v1_routes_take_the_right_key(server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=auth, timeout=30) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny"
        completion = client.post("/v1/completions", json={**COMPLETION, "ignore_eos": True})
        assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 2
        lowercase = client.get("/v1/models", headers={"Authorization": f"bearer {KEY}"})
        assert lowercase.status_code == 200
        assert client.post("/reset_prefix_cache").status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/version"])
def test_operational_routes_stay_open(server: ServerProcess, path: str) -> None:
    assert httpx.get(server.url + path, timeout=10).status_code == 200


def test_the_openai_client_with_and_without_the_key(server: ServerProcess) -> None:
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    assert good.completions.create(model="tiny", prompt="Hi", max_tokens=2).usage.completion_tokens >= 1
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_a_body_over_the_limit_is_413(server: ServerProcess) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    big = {"prompt": [1] * MAX_BYTES, "max_tokens": 1}
    response = httpx.post(f"{server.url}/v1/completions", json=big, headers=auth, timeout=10)
    assert_error(response, 413, "RequestTooLargeError")
    assert "--max-request-bytes" in response.json()["error"]["message"]
    # Without the key, the key is what is wrong.
    response = httpx.post(f"{server.url}/v1/completions", json=big, timeout=10)
    assert response.status_code == 401
    # Just under the limit is read and answered as usual.
    fits = {"prompt": "x", "max_tokens": 1, "user": "u" * (MAX_BYTES - 100)}
    assert httpx.post(f"{server.url}/v1/completions", json=fits, headers=auth, timeout=30).status_code == 200


@pytest.mark.parametrize(
    ("framing", "parts"),
    [
        # Content-Length of a gigabyte, no body sent: answered from the header alone.
        (b"Content-Length: 1000000000\r\n", []),
        # Chunked, over the limit, and never ended: answered while reading.
        (b"Transfer-Encoding: chunked\r\n", [b"800\r\n" + b" " * 0x800 + b"\r\n"] * 3),
    ],
)
def test_413_comes_before_the_body_is_read_whole(
    server: ServerProcess, framing: bytes, parts: list[bytes]
) -> None:
    host = server.url.removeprefix("http://").encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: " + host + b"\r\nAuthorization: Bearer " + KEY.encode()
        + b"\r\nContent-Type: application/json\r\n" + framing + b"\r\n"
    )  # fmt: skip
    answer = raw_exchange(server.url, head, parts)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    assert b'"type":"RequestTooLargeError"' in answer


def test_still_serving_afterwards(server: ServerProcess, start_server: Callable[..., ServerProcess]) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    response = httpx.post(f"{server.url}/v1/completions", json=COMPLETION, headers=auth, timeout=30)
    assert response.status_code == 200
    # --api-key on the command line works too (the environment variable is only its default).
    flagged = start_server("--api-key", "from-the-flag")
    assert httpx.get(f"{flagged.url}/v1/models", timeout=10).status_code == 401
    authorized = {"Authorization": "Bearer from-the-flag"}
    assert httpx.get(f"{flagged.url}/v1/models", headers=authorized, timeout=10).status_code == 200

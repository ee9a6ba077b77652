"""The client keeps up with busy streams: the fidelity of bench's throughput to the server's own pace.

A fake server in its own process streams at a known pace; the closed loop must come near the ideal
that pace allows, and the client must spend little CPU on a chunk (see README, "Against `vllm bench
serve`": a slow client reads chunks and sends new requests late, and measures a slower server).
"""

from __future__ import annotations

import json
import time

from bench.client import Endpoint
from bench.fake_server import FakeServerConfig, FakeServerProcess
from bench.runner import LoadConfig, run_closed_loop
from bench.workload import WorkloadSpec

# One SSE chunk as the fake server sends it: what `_machine_us_per_chunk` parses to time this machine.
CHUNK = (
    b'data: {"id":"cmpl-1","object":"text_completion","created":1,"model":"fake-model","choices":'
    b'[{"index":0,"text":" tok","logprobs":null,"finish_reason":null}]}\n\n'
)


def _machine_us_per_chunk(n: int = 20000) -> float:
    """CPU seconds this machine takes, right now, to split and json-parse one chunk by hand: the
    yardstick the client's cost is held to, so a slow hour of a shared machine moves both."""
    start = time.process_time()
    for _ in range(n):
        for line in CHUNK.split(b"\n"):
            if line.startswith(b"data: "):
                json.loads(line[6:])
    return (time.process_time() - start) / n


def test_the_client_keeps_up_with_32_busy_streams():
    """32 streams of a chunk every 4 ms (8,000 chunks/s, about vLLM's rate on an H200 at 32 in flight)
    from a fake server whose request time is known: the closed loop must come near the ideal (every
    slot busy from the first request to the last), and the client must spend little CPU on a chunk.

    With httpx as the transport the client spent 125-153 us of CPU a chunk here (aiohttp 42-57 us,
    on a 2-core machine with another busy process) and reached 64-85 % of the ideal (aiohttp 87-96 %):
    it read chunks and sent new requests late, which is how bench came out 3 % under `vllm bench
    serve` on a GPU. The CPU is held to this machine's own pace (`_machine_us_per_chunk`, 4-6 us on a
    quiet hour): aiohttp 8-10 of those a chunk, httpx ~25. In slow hours of the shared machine the
    client took 98-105 us a chunk and reached 73-75 % of the ideal in a run, hence the margins and
    the best of up to three runs."""
    ttft_s, itl_s, tokens, concurrency, waves = 0.05, 0.004, 64, 32, 4
    ideal = waves * concurrency * tokens / (waves * (ttft_s + (tokens - 1) * itl_s))
    floor = 0.7 * ideal

    def cpu_bound(yardstick: float) -> float:
        return max(90e-6, 16 * yardstick)

    attempts = []
    with FakeServerProcess(FakeServerConfig(ttft_s=ttft_s, itl_s=itl_s)) as fake:
        endpoint = Endpoint(fake.base_url, "fake-model")
        workload = WorkloadSpec(kind="fixed", input_len=256, output_len=tokens)
        run_closed_loop(endpoint, workload, concurrency, LoadConfig(n_requests=concurrency, progress=False))
        # A cost is the least of a few measurements (as timeit advises): a slow moment of a shared
        # machine only ever adds to it.
        for _ in range(3):
            yardstick = _machine_us_per_chunk()
            level = run_closed_loop(
                endpoint, workload, concurrency, LoadConfig(n_requests=waves * concurrency, progress=False)
            )
            yardstick = (yardstick + _machine_us_per_chunk()) / 2
            summary = level.summary
            assert summary["failures"] == 0
            chunks = sum(row.chunks for row in level.rows)
            cpu_per_chunk = summary["client_cpu_util"] * summary["duration_s"] / chunks
            attempts.append((cpu_per_chunk, yardstick, summary))
            if cpu_per_chunk < cpu_bound(yardstick) and summary["output_tok_s"] >= floor:
                break
    figures = "; ".join(
        f"{s['output_tok_s']:.0f} tok/s of an ideal {ideal:.0f}, TTFT p50 {s['ttft_p50_s'] * 1e3:.1f} ms "
        f"(server {ttft_s * 1e3:.0f}), client CPU {cpu * 1e6:.0f} us a chunk, "
        f"{cpu / yard:.1f} x this machine's {yard * 1e6:.1f} us yardstick"
        for cpu, yard, s in attempts
    )
    cpu_per_chunk, yardstick, summary = min(attempts, key=lambda attempt: attempt[0])
    assert cpu_per_chunk < cpu_bound(yardstick), figures
    assert max(s["output_tok_s"] for _, _, s in attempts) >= floor, figures

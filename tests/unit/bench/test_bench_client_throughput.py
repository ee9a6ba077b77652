"""How many streamed tokens per second one client process sustains, against a fast fake server.

The fake server runs in its own process with no delays; the figure printed is output tokens/s as the
client measured it, with the client's own CPU use beside it: near 100 % CPU means the client is the
limit, lower means the fake server (one Python process) was. Kept to a couple of seconds; reported,
not held to a figure.
"""

import pytest

from bench.client import Endpoint
from bench.fake_server import FakeServerConfig, FakeServerProcess
from bench.runner import LoadConfig, run_closed_loop
from bench.workload import WorkloadSpec

CONCURRENCY, REQUESTS, TOKENS = 32, 256, 256


@pytest.fixture(scope="module")
def fast_server():
    with FakeServerProcess(FakeServerConfig()) as fake:
        yield Endpoint(fake.base_url, "fake-model")


@pytest.mark.serial
def test_client_streamed_tokens_per_second(benchmark, fast_server):
    workload = WorkloadSpec(kind="fixed", input_len=16, output_len=TOKENS)
    load = LoadConfig(n_requests=REQUESTS, progress=False)
    run_closed_loop(fast_server, workload, CONCURRENCY, LoadConfig(n_requests=CONCURRENCY, progress=False))

    result = benchmark.pedantic(
        run_closed_loop, args=(fast_server, workload, CONCURRENCY, load), rounds=1, iterations=1
    )
    summary = result.summary
    assert summary["failures"] == 0
    assert summary["completed"] == REQUESTS
    benchmark.extra_info.update(
        output_tok_s=summary["output_tok_s"],
        client_cpu_util=summary["client_cpu_util"],
        client_loop_lag_p99_s=summary["client_loop_lag_p99_s"],
    )
    print(
        f"\none client process: {summary['output_tok_s']:.0f} streamed tokens/s "
        f"({CONCURRENCY} streams, client CPU {summary['client_cpu_util']:.0%}, "
        f"loop lag p99 {summary['client_loop_lag_p99_s'] * 1e3:.1f} ms)"
    )

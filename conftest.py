"""Shared pytest set-up: one CPU thread per test worker, the `gpu` marker's skip, and synthetic model
folders made once per session.

Tests marked `gpu` skip cleanly where torch sees no CUDA device. Model folders are written by
engine.synthetic into a session temp dir (a few seconds each), never downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Under pytest-xdist every core already runs a worker, and each worker's servers add an API
    # process and an engine core: torch's default of one OpenMP thread per core in each of them
    # oversubscribes the machine, and OpenMP threads that spin-wait for a descheduled sibling made
    # the CPU tests much slower (the unit step took 720 s on 2 cores, 427-541 s with this) and
    # stretched a 22-token answer past a 15 s deadline. Set before torch is imported; the servers
    # and cores the tests start inherit it. An explicit OMP_NUM_THREADS wins.
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any("gpu" in item.keywords for item in items):
        return  # torch not imported for nothing (~1.5 s: the perf tier's runs collect no gpu test)
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if has_cuda:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _free_gpu_memory_between_tests():
    """An engine sizes its KV cache from free GPU memory: one left by the previous test (not yet
    collected) would leave it none."""
    yield
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def _synthetic(tmp_path_factory: pytest.TempPathFactory, preset: str, **kwargs) -> Path:
    from engine.synthetic import write_checkpoint

    return write_checkpoint(preset, tmp_path_factory.mktemp(preset), **kwargs)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Qwen2 layout (q/k/v bias, tied embeddings), with a ChatML chat template."""
    return _synthetic(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_llama_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama layout (untied, llama3 rope scaling), no chat template, weights split over several files."""
    return _synthetic(tmp_path_factory, "tiny-llama", max_shard_bytes=8 << 20)


def pytest_addoption(parser: pytest.Parser) -> None:
    """Options of the perf tier (`pytest -m perf`); see tests/perf/conftest.py."""
    group = parser.getgroup("perf", "performance tier against a stored vLLM baseline")
    group.addoption(
        "--target",
        choices=["engine", "vllm", "both"],
        default="engine",
        help="server(s) to measure; both = vLLM then the engine, same machine",
    )
    group.addoption(
        "--model",
        default=None,
        help="a synthetic preset or a model folder (default: qwen2.5-1.5b on GPU, tiny on CPU)",
    )
    group.addoption(
        "--profile",
        choices=["smoke", "short", "full"],
        default=None,
        help="default: full on GPU, smoke on CPU",
    )
    group.addoption(
        "--trials", type=int, default=None, help="timed rounds per case (default: 3 on GPU, 1 on CPU)"
    )
    group.addoption(
        "--server-url",
        default=None,
        help="measure a server that is already running (…/v1) instead of starting one",
    )
    group.addoption(
        "--server-info",
        action="append",
        default=[],
        help="measure a server started by `python -m bench serve` (its description JSON; once per "
        "target), recording the flags it was started with",
    )
    group.addoption(
        "--baseline",
        action="append",
        default=[],
        help="reference summary JSON for the sampling mode it was measured in; once per mode (default: "
        "baselines/<gpu>/<model>/vllm-seed-mix.json, else engine-seed-mix.json; sampled: "
        "vllm-seed-mix-sampled.json, else engine-seed-mix-sampled.json)",
    )
    group.addoption(
        "--save-baseline",
        action="store_true",
        help="store each target's summary of each sampling mode measured under baselines/<gpu>/<model>/ "
        "(<target>-seed-mix.json, <target>-seed-mix-sampled.json; -k sampled stores only that one)",
    )
    group.addoption(
        "--perf-out",
        default="perf-out",
        help="folder for summaries, server logs, the HTML report and synthetic models",
    )


def pytest_benchmark_update_machine_info(config: pytest.Config, machine_info: dict) -> None:
    """pytest-benchmark records no GPU, driver or library versions: add them."""
    from bench.machine import checkout_engine_version, describe_machine

    machine_info["perf"] = describe_machine(checkout_engine_version())

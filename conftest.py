"""Shared pytest set-up: the `gpu` marker's skip, and synthetic model folders made once per session.

Tests marked `gpu` skip cleanly where torch sees no CUDA device. Model folders are written by
engine.synthetic into a session temp dir (a few seconds each), never downloaded.
"""

from __future__ import annotations

from pathlib import Path

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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

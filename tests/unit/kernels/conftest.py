"""Kernel tests run on CUDA, or on CPU through Triton's interpreter (TRITON_INTERPRET=1 before triton
is imported, which is why scripts/test.sh runs this folder in its own pytest invocation). Elsewhere
they skip with that reason. The interpreter gets tiny shapes in float32/float16 (it computes bf16
wrongly on CPU); CUDA gets the shapes that matter in bf16 and fp16."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ON_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    reason = None
    if importlib.util.find_spec("triton") is None:
        reason = "triton is not installed"
    elif not ON_CUDA and not INTERPRET:
        reason = "no CUDA device: run with TRITON_INTERPRET=1 to test the kernels on CPU"
    if reason is None:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_CUDA else "cpu")

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


# The interpreter runs a kernel's programs one after another in Python, idle ones too: the planned decode
# kernel's grid (FILL_PER_SM programs a SM over the KV heads, however few the rows) would spend most of a
# tiny model's test on programs with no work item. Under the interpreter its grids are sized for a
# device of this many SMs; the planning is the same arithmetic at any count (test_planned_decode_attention
# sweeps the program counts themselves).
INTERPRETER_SMS = 8


@pytest.fixture(autouse=True)
def _interpreter_sized_grids(monkeypatch):
    if INTERPRET and not ON_CUDA:
        from engine.kernels import planned_decode_attention

        monkeypatch.setattr(planned_decode_attention, "num_sms", lambda device_index=None: INTERPRETER_SMS)
    yield

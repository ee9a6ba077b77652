"""The perf tier run as a user runs it: `pytest -m perf tests/perf -q ARGS` in a subprocess from the
repository root. Shared by the tests that drive the tier end to end (bench serve, the gate, the smoke)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def perf_tier_command(args: list[str]) -> list[str]:
    """`pytest -m perf tests/perf -q ARGS` with this interpreter, to run from the repository root."""
    return [sys.executable, "-m", "pytest", "-m", "perf", "tests/perf", "-q", *args]


def run_perf_tier(
    args: list[str], timeout_s: float, env: Mapping[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """The tier with ARGS, its output captured; env adds to this process's environment (None: drops
    the variable)."""
    environment = {**os.environ, **(env or {})}
    return subprocess.run(
        perf_tier_command(args),
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout_s,
        env={name: value for name, value in environment.items() if value is not None},
    )

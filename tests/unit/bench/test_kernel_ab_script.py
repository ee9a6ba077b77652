"""scripts/kernel_ab.sh (a decode kernel change against a base commit in one GPU call): on a machine
that cannot run it, it says why and exits 2 before doing anything, instead of timing nothing."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A tree holding the script alone."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "kernel_ab.sh", tmp_path / "scripts" / "kernel_ab.sh")
    return tmp_path


def run(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/kernel_ab.sh", *args], cwd=tree, capture_output=True, text=True)


def test_usage_and_a_missing_base_exit_2_naming_the_fix(tree: Path):
    usage = run(tree)
    assert usage.returncode == 2 and "usage: scripts/kernel_ab.sh OUT_DIR" in usage.stderr
    no_base = run(tree, str(tree / "out"))
    assert no_base.returncode == 2 and "scripts/base_tree.sh prepare BASE" in no_base.stderr
    assert not (tree / "out").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no CUDA device")
def test_without_a_gpu_it_refuses_before_building_anything(tree: Path):
    (tree / ".base-tree").mkdir()
    (tree / ".base-tree" / "ref.txt").write_text("0" * 40 + "\n")
    refused = run(tree, str(tree / "out"))
    assert refused.returncode == 2 and "no CUDA device" in refused.stderr
    assert not (tree / "out").exists()

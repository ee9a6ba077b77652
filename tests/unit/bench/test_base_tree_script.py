"""scripts/base_tree.sh: a commit's tree rebuilt from the working tree and the files stored by
`prepare`, without git (as on the GPU machine, which gets no .git)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, cwd=cwd, capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A git repository with the script, one commit (a, b, sub/d), then changes in its working tree:
    a edited, sub/d deleted, c added and tracked, u untracked."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "base_tree.sh", root / "scripts" / "base_tree.sh")
    (root / "a.txt").write_text("a as committed\n")
    (root / "b.txt").write_text("b unchanged\n")
    (root / "sub").mkdir()
    (root / "sub" / "d.txt").write_text("d as committed\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    for command in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        assert run(git + command, root).returncode == 0
    (root / "a.txt").write_text("a changed\n")
    (root / "sub" / "d.txt").unlink()
    (root / "c.txt").write_text("c new\n")
    assert run(git + ["add", "c.txt"], root).returncode == 0
    (root / "u.txt").write_text("u untracked\n")
    return root


def test_build_gives_the_commits_files_without_git(repo: Path, tmp_path: Path):
    prepared = run(["bash", "scripts/base_tree.sh", "prepare", "HEAD"], repo)
    assert prepared.returncode == 0, prepared.stderr
    assert "stored 2 files" in prepared.stdout and "1 new since" in prepared.stdout
    # on the GPU machine: no .git, only the working tree and the carried store
    shutil.rmtree(repo / ".git")
    dest = tmp_path / "base"
    built = run(["bash", "scripts/base_tree.sh", "build", str(dest)], repo)
    assert built.returncode == 0, built.stderr
    assert (dest / "a.txt").read_text() == "a as committed\n"
    assert (dest / "b.txt").read_text() == "b unchanged\n"
    assert (dest / "sub" / "d.txt").read_text() == "d as committed\n"
    assert not (dest / "c.txt").exists(), "a file the commit lacks is left out"
    assert (dest / "u.txt").exists(), "untracked files travel as they are"
    assert not (dest / ".base-tree").exists() and (dest / "scripts" / "base_tree.sh").exists()
    assert (repo / "a.txt").read_text() == "a changed\n", "the working tree itself is untouched"


def test_bad_usage_exits_2_with_the_reason(repo: Path, tmp_path: Path):
    assert run(["bash", "scripts/base_tree.sh", "prepare", "no-such-ref"], repo).returncode == 2
    unprepared = run(["bash", "scripts/base_tree.sh", "build", str(tmp_path / "x")], repo)
    assert unprepared.returncode == 2 and "prepare REF" in unprepared.stderr
    assert run(["bash", "scripts/base_tree.sh", "frobnicate", "x"], repo).returncode == 2

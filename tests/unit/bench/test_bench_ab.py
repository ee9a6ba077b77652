"""`bench ab` on CPU: two commits of a small repository whose `python -m server` is bench's fake server
(known timings), each side started from its own git worktree, trials interleaved. A commit made 20%
slower is caught; the same server on both sides passes."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.ab import AbConfig, AbError, resolve, run_ab
from bench.offline import OfflineLoad
from bench.profiles import Profile
from bench.runner import LoadConfig

# No sweep, one closed loop of 16 requests at 8 in flight: a few seconds a trial against the fake server.
TINY = Profile(
    name="ab-test",
    sweep=None,
    sweep_load=LoadConfig(n_requests=1, progress=False),
    concurrencies=(8,),
    closed_load=LoadConfig(n_requests=16, progress=False),
    warmup=LoadConfig(n_requests=4, progress=False),
    warmup_concurrency=4,
    offline=OfflineLoad(),
)

SERVER = '''"""A stand-in for this project's server: bench's fake server with fixed timings."""
import sys

from bench.fake_server import main

args = sys.argv[1:]
main(["--port", args[args.index("--port") + 1], "--ttft-s", "0.01", "--itl-s", "{itl}"])
'''


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Three commits: `base` (ITL 2 ms), `same` (a README change, same server), `slower` (ITL 2.5 ms:
    ~20% fewer tokens/s)."""
    folder = tmp_path_factory.mktemp("ab-repo")
    _git(folder, "init", "-q")
    (folder / "server").mkdir()
    for name, itl, note in (("base", "0.002", "v1"), ("same", "0.002", "v2"), ("slower", "0.0025", "v3")):
        (folder / "server" / "__main__.py").write_text(SERVER.format(itl=itl))
        (folder / "README").write_text(note)
        _git(folder, "add", ".")
        _git(folder, "commit", "-q", "-m", name)
        _git(folder, "tag", name)
    return folder


def _config(repo: Path, tmp_path: Path, new_ref: str) -> AbConfig:
    return AbConfig(
        "base", new_ref, str(tmp_path), TINY, trials=2, dtype="float32", repo=str(repo),
        work_dir=str(tmp_path / "ab"), start_timeout_s=60, log=lambda line: None,
    )  # fmt: skip


def test_a_commit_20_percent_slower_is_caught(repo, tmp_path):
    started = time.monotonic()
    result = run_ab(_config(repo, tmp_path, "slower"))
    comparison = result.comparison
    regressed = {(row.level, row.metric) for row in comparison.regressions}
    assert ("concurrency 8", "output_tok_s") in regressed
    assert ("concurrency 8", "tpot_p50_s") in regressed
    output = next(row for row in comparison.rows if row.metric == "output_tok_s")
    assert 0.72 < output.ratio < 0.88  # ~0.8: each side really ran its own worktree's server
    assert comparison.exit_status() == 1
    assert result.summaries["base"]["commit"] == resolve(repo, "base")
    assert result.summaries["new"]["trials"] == 2 and result.paths["new"].is_file()
    assert not list((tmp_path / "ab").glob("worktree-*")), "worktrees are removed"
    assert time.monotonic() - started < 90


def test_the_same_server_on_both_sides_passes(repo, tmp_path):
    comparison = run_ab(_config(repo, tmp_path, "same")).comparison
    assert comparison.regressions == [] and comparison.unreliable == [], comparison.table()
    assert comparison.exit_status() == 0


def test_a_ref_that_does_not_resolve(repo, tmp_path, capsys):
    with pytest.raises(AbError, match="rev-parse"):
        run_ab(_config(repo, tmp_path, "no-such-ref"))
    argv = [
        "ab",
        "base",
        "no-such-ref",
        "--model",
        str(tmp_path),
        "--repo",
        str(repo),
        "--work",
        str(tmp_path / "w"),
    ]
    assert main(argv) == 2
    assert "error: git rev-parse" in capsys.readouterr().err

"""`bench ab` on CPU: two commits of a small repository whose `python -m server` is bench's fake server
(known timings), each side started from its own git worktree, three trials interleaved as the gate runs
them. A commit made 20% slower is caught on every gated figure; the same server on both sides passes,
which asks for a measurement that holds still on a busy 2-core machine (see TINY and SERVER)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.ab import AbConfig, AbError, resolve, run_ab
from bench.offline import OfflineLoad
from bench.profiles import Profile
from bench.runner import LoadConfig

# Why these loads and timings: with 16 requests at 8 in flight, a first chunk after 10 ms and a token
# every 2 ms, the same server's TTFT p50 moved 10-40% between trials. Half of those requests were the
# burst that opens a closed loop (eight sent at once on new connections: 25-45 ms) and half came after
# it (13-18 ms), so the median was the midpoint of the gap between the two. And the fake server's
# chunk timers wake on epoll's 1-ms ticks, so 2-ms gaps came out near 1.2 or 2.2 ms and the ITL p50
# flipped between them. Now the burst is left out of each level's figures (LoadConfig.warmup) and 32
# requests after it are measured, and the server's times are long next to the few ms a busy machine
# adds: a first chunk after 100 ms, then ten tokens every 20 ms (2 ms a token as before, a tenth of
# the chunks for the client and the server to handle).
CONCURRENCY = 8
# No sweep, one closed loop at 8 in flight: ~2 s a level against the fake server.
TINY = Profile(
    name="ab-test",
    sweep=None,
    sweep_load=LoadConfig(n_requests=1, progress=False),
    concurrencies=(CONCURRENCY,),
    closed_load=LoadConfig(n_requests=32, warmup=CONCURRENCY, progress=False),
    warmup=LoadConfig(n_requests=4, progress=False),
    warmup_concurrency=4,
    offline=OfflineLoad(),
)

SERVER = '''"""A stand-in for this project's server: bench's fake server with fixed timings."""
import sys

from bench.fake_server import main

args = sys.argv[1:]
port = args[args.index("--port") + 1]
main(["--port", port, "--ttft-s", "{ttft}", "--itl-s", "{itl}", "--tokens-per-chunk", "10"])
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
    """Three commits: `base` (first chunk after 100 ms, then ten tokens every 20 ms), `same` (a README
    change, same server), `slower` (every time 1.25x: 125 ms, 25 ms; 20% fewer tokens/s)."""
    folder = tmp_path_factory.mktemp("ab-repo")
    _git(folder, "init", "-q")
    (folder / "server").mkdir()
    commits = (
        ("base", "0.1", "0.02", "v1"),
        ("same", "0.1", "0.02", "v2"),
        ("slower", "0.125", "0.025", "v3"),
    )
    for name, ttft, itl, note in commits:
        (folder / "server" / "__main__.py").write_text(SERVER.format(ttft=ttft, itl=itl))
        (folder / "README").write_text(note)
        _git(folder, "add", ".")
        _git(folder, "commit", "-q", "-m", name)
        _git(folder, "tag", name)
    return folder


def _config(repo: Path, tmp_path: Path, new_ref: str, log: list[str] | None = None) -> AbConfig:
    return AbConfig(
        "base", new_ref, str(tmp_path), TINY, trials=3, dtype="float32", repo=str(repo),
        work_dir=str(tmp_path / "ab"), start_timeout_s=60, log=(log if log is not None else []).append,
    )  # fmt: skip


# The gated figures of a closed loop: the slower commit must fail each, the same server none.
GATED = {"output_tok_s", "ttft_p50_s", "itl_p50_s", "tpot_p50_s", "failures"}
# A deadline that catches a run that hangs or loops (six trials of ~2 s, each a server start): not a
# speed, which the ratio of the two sides' figures, measured interleaved, is.
AB_RUN_DEADLINE_S = 300


@pytest.mark.serial
def test_a_commit_20_percent_slower_is_caught(repo, tmp_path):
    started = time.monotonic()
    log: list[str] = []
    result = run_ab(_config(repo, tmp_path, "slower", log))
    # pairs base new, new base, base new, each trial with a server of its own (its own log)
    sides = [line.split(" of ")[1].split()[0] for line in log if line.startswith("bench ab: trial")]
    assert sides == ["base", "new", "new", "base", "base", "new"], log
    for side in ("base", "new"):
        logs = sorted(path.name for path in (tmp_path / "ab").glob(f"{side}-server-*.log"))
        assert logs == [f"{side}-server-{n}.log" for n in (1, 2, 3)]
        assert all((tmp_path / "ab" / name).stat().st_size > 0 for name in logs)
    comparison = result.comparison
    regressed = {row.metric for row in comparison.regressions if row.level == "concurrency 8"}
    assert regressed == GATED - {"failures"}, comparison.table()
    output = next(row for row in comparison.rows if row.metric == "output_tok_s")
    assert 0.72 < output.ratio < 0.88  # ~0.8: each side really ran its own worktree's server
    assert comparison.exit_status() == 1
    assert result.summaries["greedy"]["base"]["commit"] == resolve(repo, "base")
    assert result.summaries["greedy"]["new"]["trials"] == 3 and result.paths["greedy"]["new"].is_file()
    assert not list((tmp_path / "ab").glob("worktree-*")), "worktrees are removed"
    assert time.monotonic() - started < AB_RUN_DEADLINE_S


@pytest.mark.serial
def test_the_same_server_on_both_sides_passes(repo, tmp_path):
    comparison = run_ab(_config(repo, tmp_path, "same")).comparison
    assert {row.metric for row in comparison.decided if row.level == "concurrency 8"} == GATED
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


# -- more trials while the verdict is unreliable (servers replaced by known figures) ----------------
def _known_trials(monkeypatch, figures: dict[str, list[float]]) -> list[tuple[str, int]]:
    """run_trial replaced: trial n of a side measures figures[side][n - 1] output tok/s at 8 in flight
    (everything else the same on both sides). Returns the (side, n) of each trial as it runs."""
    import bench.ab

    ran: list[tuple[str, int]] = []

    def fake_trial(config, side, worktree, number):
        ran.append((side, number))
        level = {"concurrency": CONCURRENCY, "output_tok_s": figures[side][number - 1], "ttft_p50_s": 0.1}
        level |= {"itl_p50_s": 0.002, "tpot_p50_s": 0.002, "failures": 0}
        return {"greedy": {"sweep": None, "closed": [level], "failed": []}}

    monkeypatch.setattr(bench.ab, "run_trial", fake_trial)
    return ran


def test_an_unreliable_verdict_gets_more_trials_until_it_is_decided(repo, tmp_path, monkeypatch):
    # 6 % fewer tokens/s (limit 5 %, base band 5 %); after three trials a side the trials overlap too
    # much to tell (p = 0.055), a fourth pair (new first, as pairs alternate) decides it.
    ran = _known_trials(
        monkeypatch, {"base": [100.0, 95.0, 105.0, 100.0, 101.0], "new": [94.0, 93.0, 95.0, 94.0, 94.5]}
    )
    log: list[str] = []
    config = _config(repo, tmp_path, "same", log)
    config.max_trials = 5
    result = run_ab(config)
    assert ran == [
        ("base", 1),
        ("new", 1),
        ("new", 2),
        ("base", 2),
        ("base", 3),
        ("new", 3),
        ("new", 4),
        ("base", 4),
    ]
    assert any("unreliable; one more trial a side (4 of at most 5)" in line for line in log), log
    assert [row.metric for row in result.comparison.regressions] == ["output_tok_s"]
    assert result.summaries["greedy"]["new"]["trials"] == 4 and result.comparison.exit_status() == 1


def test_without_max_trials_an_unreliable_verdict_stays_one(repo, tmp_path, monkeypatch):
    ran = _known_trials(monkeypatch, {"base": [100.0, 95.0, 105.0], "new": [94.0, 93.0, 95.0]})
    result = run_ab(_config(repo, tmp_path, "same"))
    assert len(ran) == 6 and result.comparison.exit_status() == 4


def test_a_decided_verdict_gets_no_more_trials(repo, tmp_path, monkeypatch):
    ran = _known_trials(monkeypatch, {"base": [100.0, 99.0, 101.0], "new": [100.5, 99.5, 100.0]})
    config = _config(repo, tmp_path, "same")
    config.max_trials = 6
    assert run_ab(config).comparison.exit_status() == 0 and len(ran) == 6


def test_max_trials_fewer_than_trials_is_refused(repo, tmp_path, capsys):
    argv = ["ab", "base", "same", "--model", str(tmp_path), "--repo", str(repo), "--trials", "3"]
    with pytest.raises(SystemExit) as stopped:
        main([*argv, "--max-trials", "2"])
    assert stopped.value.code == 2 and "--max-trials 2 is fewer than --trials 3" in capsys.readouterr().err


# -- both sampling modes ---------------------------------------------------------------------------
BOTH = dataclasses.replace(TINY, sampling=("greedy", "sampled"))


def test_a_profile_with_both_modes_measures_and_compares_each(repo, tmp_path):
    # One trial a side against the stand-in servers: each trial measures both modes on its server,
    # and each mode's summaries land in files of their own, compared on their own.
    config = _config(repo, tmp_path, "same")
    config.profile, config.trials = BOTH, 1
    result = run_ab(config)
    for mode, name in (("greedy", "seed-mix.json"), ("sampled", "seed-mix-sampled.json")):
        for side in ("base", "new"):
            assert result.paths[mode][side] == tmp_path / "ab" / f"{side}-{name}"
            assert json.loads(result.paths[mode][side].read_text())["sampling"] == mode
        level = result.summaries[mode]["new"]["closed_loop"][0]
        assert level["concurrency"] == CONCURRENCY
        # the client's own load rides along, so a side the client capped shows it
        assert level["client_cpu_util"] > 0.0 and level["client_loop_lag_p99_s"] >= 0.0, level
    levels = {row.level for row in result.comparison.rows}
    assert {"concurrency 8", "sampled: concurrency 8"} <= levels, levels


def test_a_regression_in_the_sampled_mode_alone_is_caught(repo, tmp_path, monkeypatch):
    # greedy alike on both sides, sampled 20 % fewer tokens/s in new: one regression, named sampled
    import bench.ab

    figures = {
        ("base", "greedy"): [100.0, 99.0, 101.0],
        ("new", "greedy"): [100.5, 99.5, 100.0],
        ("base", "sampled"): [50.0, 49.5, 50.5],
        ("new", "sampled"): [40.0, 39.5, 40.5],
    }

    def fake_trial(config, side, worktree, number):
        def measured(mode: str) -> dict:
            level = {
                "concurrency": CONCURRENCY,
                "output_tok_s": figures[side, mode][number - 1],
                "failures": 0,
            }
            return {"sweep": None, "closed": [level], "failed": []}

        return {mode: measured(mode) for mode in config.profile.sampling}

    monkeypatch.setattr(bench.ab, "run_trial", fake_trial)
    config = _config(repo, tmp_path, "same")
    config.profile = BOTH
    comparison = run_ab(config).comparison
    assert [(row.level, row.metric) for row in comparison.regressions] == [
        ("sampled: concurrency 8", "output_tok_s")
    ], comparison.table()
    assert comparison.exit_status() == 1

"""The CPU smoke catches a 2x slower engine: the perf tier's offline case and closed loop at 4 in flight,
with every engine step followed by a sleep as long as the step (PERF_INJECT_SLOWDOWN=2, bench.slowdown),
fail their `[engine]` budgets against baselines/cpu/tiny/engine-seed-mix.json. The same cases without
the slowdown pass in every CI run (scripts/test.sh's smoke)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from perf_tier_process import run_perf_tier

# The closed loop at 4 in flight is judged on the median of three trials (the tier's fold). One trial is
# six requests and spreads about 7%. A busy machine only slows the slowed engine further (0.37x of the
# reference beside a CPU burner), but while this machine ran quiet and fast, single trials of it came
# to 0.56-0.64x, just under the 0.65 budget, and one run stayed above it. The offline case stays one
# trial: its requests all start at once, so its batches do not hang on timing, and its figures sit
# further past their budgets (0.42-0.53x, 1.9-3x).
CLOSED_LOOP_TRIALS = 3


def _slowed_tier(selection: str, trials: int, out: Path) -> subprocess.CompletedProcess[str]:
    arguments = ["-rs", "--profile", "smoke", "--model", "tiny", "--trials", str(trials)]
    arguments += ["--perf-out", str(out), "-k", selection]
    run = run_perf_tier(arguments, timeout_s=400, env={"PERF_INJECT_SLOWDOWN": "2"})
    print(*re.findall(r"^  .+ \(budget .+$", run.stdout, re.MULTILINE), sep="\n")  # the margins, for -rP
    assert run.returncode == 1, run.stdout[-3000:]
    return run


def _failed(out: str) -> set[str]:
    """The figures the tier's summary lists as past their budgets: `concurrency 4 output_tok_s:`..."""
    return {" ".join(line.split()[:3]) for line in re.findall(r"^  (.+) FAILS$", out, re.MULTILINE)}


def test_a_2x_slower_engine_fails_the_smoke_budgets(tmp_path):
    offline = _slowed_tier("offline", 1, tmp_path / "offline")
    assert "engine steps made 2x slower" in (tmp_path / "offline" / "engine-offline.log").read_text()
    assert {"offline all output_tok_s:", "offline probes single_tpot_s:"} <= _failed(offline.stdout), (
        offline.stdout[-3000:]
    )
    closed = _slowed_tier("closed_loop and 4", CLOSED_LOOP_TRIALS, tmp_path / "closed")
    assert "engine steps made 2x slower" in (tmp_path / "closed" / "engine-server.log").read_text()
    assert f"{CLOSED_LOOP_TRIALS} trial(s), profile smoke" in closed.stdout, closed.stdout[-3000:]
    assert "concurrency 4 output_tok_s:" in _failed(closed.stdout), closed.stdout[-3000:]

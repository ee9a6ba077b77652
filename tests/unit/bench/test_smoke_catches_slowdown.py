"""The CPU smoke catches a 2x slower engine: the perf tier's offline case and closed loop at 4 in flight,
with every engine step followed by a sleep as long as the step (PERF_INJECT_SLOWDOWN=2, bench.slowdown),
fail their `[engine]` budgets against baselines/cpu/tiny/engine-seed-mix.json. The same cases without
the slowdown pass in every CI run (scripts/test.sh's smoke)."""

from __future__ import annotations

import re

from perf_tier_process import run_perf_tier

# Each case is judged on the median of three trials (the tier's fold), not on one. The requests of a
# trial batch the same way every time, but a trial lasts 10-20 s and a shared 2-core machine's speed
# drifts over that. At quiet times, single trials of the slowed closed loop at 4 in flight came to
# 0.51-0.61x of the stored reference in 22 of 24 trials, 0.646x in one and 0.742x, past the 0.65
# budget, in one where the machine ran faster; single offline trials to 0.43-0.60x (budget 0.65) and
# 1.77-3.1x per token (budget 1.6). A busy machine only slows the slowed engine further (0.37x at 4 in
# flight beside a CPU burner).
TRIALS = 3


def test_a_2x_slower_engine_fails_the_smoke_budgets(tmp_path):
    arguments = ["-rs", "--profile", "smoke", "--model", "tiny", "--trials", str(TRIALS)]
    arguments += ["--perf-out", str(tmp_path), "-k", "offline or (closed_loop and 4)"]
    run = run_perf_tier(arguments, timeout_s=600, env={"PERF_INJECT_SLOWDOWN": "2"})
    out = run.stdout
    print(*re.findall(r"^  .+ \(budget .+$", out, re.MULTILINE), sep="\n")  # the margins, for -rP
    assert run.returncode == 1, out[-3000:]
    assert "engine steps made 2x slower" in (tmp_path / "engine-server.log").read_text()
    assert f"{TRIALS} trial(s), profile smoke" in out, out[-3000:]
    failed = re.findall(r"^  (.+) FAILS$", out, re.MULTILINE)
    # every throughput and latency figure the two cases hold falls past its budget
    held = {" ".join(line.split()[:3]) for line in failed}
    assert {
        "concurrency 4 output_tok_s:",
        "offline all output_tok_s:",
        "offline probes single_tpot_s:",
    } <= held, out[-3000:]

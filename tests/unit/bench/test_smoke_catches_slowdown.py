"""The CPU smoke catches a 2x slower engine: the perf tier's offline case and closed loop at 4 in flight,
with every engine step followed by a sleep as long as the step (PERF_INJECT_SLOWDOWN=2, bench.slowdown),
fail their `[engine]` budgets against baselines/cpu/tiny/engine-seed-mix.json. The same cases without
the slowdown pass in every CI run (scripts/test.sh's smoke)."""

from __future__ import annotations

import re

from perf_tier_process import run_perf_tier


def test_a_2x_slower_engine_fails_the_smoke_budgets(tmp_path):
    arguments = ["-rs", "--profile", "smoke", "--model", "tiny", "--trials", "1", "--perf-out", str(tmp_path)]
    arguments += ["-k", "offline or (closed_loop and 4)"]
    run = run_perf_tier(arguments, timeout_s=400, env={"PERF_INJECT_SLOWDOWN": "2"})
    out = run.stdout
    assert run.returncode == 1, out[-3000:]
    assert "engine steps made 2x slower" in (tmp_path / "engine-server.log").read_text()
    failed = re.findall(r"^  (.+) FAILS$", out, re.MULTILINE)
    # every throughput and latency figure the two cases hold falls past its budget
    held = {" ".join(line.split()[:3]) for line in failed}
    assert {
        "concurrency 4 output_tok_s:",
        "offline all output_tok_s:",
        "offline probes single_tpot_s:",
    } <= held, out[-3000:]

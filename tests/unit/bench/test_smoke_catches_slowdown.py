"""The CPU smoke's budgets catch a 2x slower engine: with every engine step followed by as long again
of computation (PERF_INJECT_SLOWDOWN=2, bench.slowdown), the perf tier's offline case and closed loop
at 4 in flight fail their `[engine]` budgets (tests/perf/budgets.toml) against a reference of the
normal engine measured on the same machine minutes before.

The reference is measured here rather than read from baselines/cpu/tiny/engine-seed-mix.json because
the machines that run CI differ in speed from the one that stored it, and from hour to hour: held to
the stored reference, the same slowed engine came to 0.49x and 0.61x of its offline throughput in two
runs (budget 0.65), 1.57-2.5x its time per token (budget 1.6) and 0.63-0.76x its throughput at 4 in
flight; held to the normal engine measured just before, to 0.44-0.52x, 2.2-2.6x and 0.37-0.50x. The smoke in CI
(scripts/test.sh) holds the normal engine to the stored reference; this test shows what the budgets
catch once machine speed is taken out.
"""

from __future__ import annotations

import json
import re

from perf_tier_process import run_perf_tier

# Each case is judged on the median of three trials (the tier's fold), not on one: a trial lasts
# 10-20 s, and a shared 2-core machine's speed drifts over that.
TRIALS = 3
CASES = ["--profile", "smoke", "--model", "tiny", "--trials", str(TRIALS)]
CASES += ["-k", "offline or (closed_loop and 4)"]


def test_a_2x_slower_engine_fails_the_smoke_budgets(tmp_path):
    normal, slowed = tmp_path / "normal", tmp_path / "slowed"
    run = run_perf_tier([*CASES, "--perf-out", str(normal)], timeout_s=600)
    reference = normal / "engine-seed-mix.json"
    assert reference.is_file(), run.stdout[-3000:]
    assert json.loads(reference.read_text())["trials"] == TRIALS

    run = run_perf_tier(
        ["-rs", *CASES, "--perf-out", str(slowed), "--baseline", str(reference)],
        timeout_s=600,
        env={"PERF_INJECT_SLOWDOWN": "2"},
    )
    out = run.stdout
    print(*re.findall(r"^  .+ \(budget .+$", out, re.MULTILINE), sep="\n")  # the margins, for -rP
    assert run.returncode == 1, out[-3000:]
    assert "engine steps made 2x slower" in (slowed / "engine-server.log").read_text()
    assert f"{TRIALS} trial(s), profile smoke" in out, out[-3000:]
    assert f"against stored {reference}" in out, out[-3000:]
    failed = re.findall(r"^  (.+) FAILS$", out, re.MULTILINE)
    # every throughput and latency figure the two cases hold falls past its budget
    held = {" ".join(line.split()[:3]) for line in failed}
    assert {
        "concurrency 4 output_tok_s:",
        "offline all output_tok_s:",
        "offline probes single_tpot_s:",
        "offline probes prefill_tok_s:",
    } <= held, out[-3000:]

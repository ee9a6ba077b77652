"""The perf tier as a gate, against bench's fake server (`--server-url`): no reference is a skip, or a
failure under PERF_REQUIRE_REFERENCE=1 (perf.yml sets it); a stored reference is drawn in the report
beside the run; --save-baseline refuses a run whose budgets failed; a stored engine reference from
another machine is shown, not judged; each trial is one pytest-benchmark round (nothing turns it off)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from perf_tier_process import perf_tier_command, run_perf_tier

from bench.fake_server import FakeServerConfig, FakeServerProcess
from bench.machine import describe_machine

REPO = Path(__file__).resolve().parents[3]


def perf_tier(
    url: str, out: Path, *args: str, env: Mapping[str, str | None] | None = None, trials: int = 1
) -> subprocess.CompletedProcess[str]:
    """The smoke profile's greedy closed loop at 1 in flight against the server at `url`."""
    arguments = [
        "-rs",
        "--server-url",
        url,
        "--profile",
        "smoke",
        "--trials",
        str(trials),
        "--perf-out",
        str(out),
    ]
    return run_perf_tier([*arguments, "-k", "closed_loop and greedy-1", *args], timeout_s=120, env=env)


@pytest.fixture(scope="module")
def fake_url():
    with FakeServerProcess(FakeServerConfig(ttft_s=0.005, itl_s=0.0005)) as fake:
        yield fake.base_url


def test_no_reference_skips_or_fails_when_one_is_required(fake_url, tmp_path):
    plain = perf_tier(fake_url, tmp_path / "a", "--model", "no-such-model")
    assert plain.returncode == 0, plain.stdout[-2000:]
    assert "1 skipped" in plain.stdout and "no baseline for cpu/no-such-model" in plain.stdout
    required = perf_tier(
        fake_url, tmp_path / "b", "--model", "no-such-model", env={"PERF_REQUIRE_REFERENCE": "1"}
    )
    assert required.returncode == 1, required.stdout[-2000:]
    assert "1 failed" in required.stdout and "--target both" in required.stdout


def fast_reference(path: Path, machine: dict | None) -> Path:
    """A stored engine reference 10x faster than the fake server, measured on `machine`."""
    reference = {
        "target": "engine",
        "date": "2026-01-01",
        "trials": 3,
        "capacity_req_s": None,
        "open_loop": [],
        "closed_loop": [{"concurrency": 1.0, "trials": 3, "output_tok_s": 1e7, "ttft_p50_s": 0.001}],
        "machine": machine,
    }
    path.write_text(json.dumps(reference))
    return path


def test_the_report_draws_the_reference_and_a_failed_run_is_not_stored(fake_url, tmp_path):
    # Measured on this machine: the [engine] budgets are judged, and fail.
    path = fast_reference(tmp_path / "reference.json", describe_machine())
    model = "gate-test-model"  # --save-baseline would store under baselines/cpu/<model>/
    stored = REPO / "baselines" / "cpu" / model
    assert not stored.exists()
    try:
        run = perf_tier(
            fake_url, tmp_path / "out", "--baseline", str(path), "--model", model, "--save-baseline"
        )
        assert run.returncode == 1 and "budgets missed" in run.stdout, run.stdout[-2000:]
        assert "not stored: 1 budget check(s) failed" in run.stdout
        assert not stored.exists()
        report = (tmp_path / "out" / "report.html").read_text()
        # the reference's own rows (the targets table and the closed loop's), its figure among them
        rows = [r for r in report.split("<tr") if "reference: engine (2026-01-01)</td>" in r]
        assert any("<td>10,000,000</td>" in r for r in rows), rows
    finally:
        if stored.exists():
            for file in stored.iterdir():
                file.unlink()
            stored.rmdir()


def test_an_engine_reference_from_another_machine_is_shown_not_judged(fake_url, tmp_path):
    # The same reference, from a host that is not this one: the figure's ratio and budget are shown,
    # the run passes; under PERF_REQUIRE_REFERENCE=1 a case that judged nothing fails.
    other = dict(describe_machine(), hostname="another-host")
    path = fast_reference(tmp_path / "reference.json", other)
    run = perf_tier(fake_url, tmp_path / "out", "--baseline", str(path), "--model", "gate-test-model")
    assert run.returncode == 0, run.stdout[-2000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("  concurrency 1 output_tok_s:")]
    assert "vs reference 1e+07" in line and "(budget >= 0.65x)" in line, line
    assert line.endswith("shown (reference from another machine)"), line
    assert "budgets: 0 judged (0 failed), 1 shown (reference from another machine), 0 skipped" in run.stdout
    assert "timings shown with their ratios, not judged" in run.stdout
    required = perf_tier(
        fake_url,
        tmp_path / "required",
        "--baseline",
        str(path),
        "--model",
        "gate-test-model",
        env={"PERF_REQUIRE_REFERENCE": "1"},
    )
    assert required.returncode == 1, required.stdout[-2000:]
    assert "a case that judged nothing fails" in required.stdout


def test_a_skipped_offline_case_writes_no_model(fake_url, tmp_path):
    # A running server holds the GPU, so the offline case skips; the preset's checkpoint (2.9 GB for
    # qwen2.5-1.5b) must not be written into the run's folder on the way to the skip.
    out = tmp_path / "out"
    arguments = [
        "-rs",
        "--server-url",
        fake_url,
        "--profile",
        "smoke",
        "--trials",
        "1",
        "--perf-out",
        str(out),
    ]
    run = run_perf_tier([*arguments, "-k", "offline", "--model", "tiny"], timeout_s=120)
    assert run.returncode == 0, run.stdout[-2000:]
    # greedy and sampled, each skipped
    assert "2 skipped" in run.stdout and "holds the GPU" in run.stdout, run.stdout[-2000:]
    assert not (out / "models").exists()


# What pytest-xdist leaves in its workers' environment: a tier started from a test worker inherits it.
XDIST_VARIABLES = ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID")


def test_each_trial_is_a_round_of_pytest_benchmark(fake_url, tmp_path):
    # pytest-benchmark turns itself off (one call, whatever the rounds; no figures in its JSON) when it
    # sees pytest-xdist at work: a --dist among pytest.ini's options, or a worker's environment. The
    # tier as `pytest -m perf` runs it must keep it on, or --trials 3 would measure one trial.
    other = dict(describe_machine(), hostname="another-host")
    path = fast_reference(tmp_path / "reference.json", other)
    out, benchmarks = tmp_path / "out", tmp_path / "benchmark.json"
    run = perf_tier(
        fake_url,
        out,
        "--baseline",
        str(path),
        "--model",
        "gate-test-model",
        "--benchmark-json",
        str(benchmarks),
        env=dict.fromkeys(XDIST_VARIABLES),
        trials=2,
    )
    assert run.returncode == 0, run.stdout[-2000:]
    assert "automatically disabled" not in run.stdout + run.stderr, (run.stdout + run.stderr)[-2000:]
    (level,) = json.loads((out / "engine-seed-mix.json").read_text())["closed_loop"]
    assert level["trials"] == 2, level
    (case,) = json.loads(benchmarks.read_text())["benchmarks"]
    assert case["stats"]["rounds"] == 2 and case["extra_info"]["case"] == "closed_loop", case["extra_info"]


def test_a_failed_case_leaves_its_figures_and_why_in_the_summary(tmp_path):
    """A case whose requests fail is written like any other, its failed requests described in the
    summary's notes: a run cut short afterwards still says why that case failed (the summaries were
    written only by cases that passed their request checks)."""
    out = tmp_path / "out"
    with FakeServerProcess(FakeServerConfig(ttft_s=0.005, itl_s=0.0005, fail_every=2)) as fake:
        run = perf_tier(fake.base_url, out, "--model", "no-such-model")
    assert run.returncode == 1 and "1 failed" in run.stdout, run.stdout[-2000:]
    summary = json.loads((out / "engine-seed-mix.json").read_text())
    (level,) = summary["closed_loop"]
    assert level["concurrency"] == 1 and level["failures"] >= 2, level
    assert any(note.startswith("failed requests, concurrency 1:") for note in summary["notes"]), summary


def test_sigterm_inside_a_case_still_ends_with_the_terminal_summary(tmp_path):
    """SIGTERM (a step's time limit) while a case's rounds run: the run ends interrupted, and the
    figures of the cases done are written and shown. pytest-benchmark, left with a benchmark of no
    rounds, crashed at the session's end (`min() iterable argument is empty`) before the tier's
    terminal summary; the tier marks such a benchmark as failed."""
    out = tmp_path / "out"
    arguments = ["-rs", "--profile", "smoke", "--trials", "1", "--perf-out", str(out)]
    arguments += ["--model", "no-such-model", "--benchmark-json", str(tmp_path / "benchmark.json")]
    # each request 1 s: the first case (6 requests at 1 in flight) ~6 s, the second (at 4) ~2 s, the
    # window in which the signal lands (the summary is polled every 50 ms)
    with FakeServerProcess(FakeServerConfig(ttft_s=1.0, itl_s=0.0005)) as fake:
        tier = subprocess.Popen(
            perf_tier_command([*arguments, "--server-url", fake.base_url, "-k", "closed_loop and greedy"]),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            summary = out / "engine-seed-mix.json"
            deadline = time.monotonic() + 90
            while not summary.exists() and tier.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert summary.exists(), "the first case wrote no summary"
            tier.send_signal(signal.SIGTERM)  # the second case's rounds have begun
            output, _ = tier.communicate(timeout=60)
        finally:
            if tier.poll() is None:
                tier.kill()
                tier.wait()
    assert tier.returncode != 0, output[-2000:]
    assert "Traceback" not in output and "min() iterable argument is empty" not in output, output[-3000:]
    assert "perf: figures and budgets" in output and "concurrency 1:" in output, output[-2000:]
    levels = json.loads(summary.read_text())["closed_loop"]
    assert [level["concurrency"] for level in levels] == [1], levels

"""scripts/offline_trials.sh, the command the GPU run is made with, on the tiny model on CPU (probes
and the profile scaled down by its env knobs): each target in turn, vLLM only where it can run."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from bench.launch import VLLM_ENV_VARIABLE

REPO = Path(__file__).resolve().parents[3]
SMALL = {
    "DTYPE": "float32",
    "N_REQUESTS": "2",
    "OFFLINE_ARGS": "--max-model-len 512 --workload fixed --input-len 32 --output-len 8 --warmup 1 "
    "--single-tokens 8 --prefill-prompts 2 --prefill-prompt-len 64",
    "PROFILE_ARGS": "--batch 1,2 --context 32 --steps 2 --max-model-len 512 --no-tables",
}


def vllm_installed() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def offline_trials(model: Path, out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != VLLM_ENV_VARIABLE}
    return subprocess.run(
        ["bash", "scripts/offline_trials.sh", str(model), str(out)],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**base, **SMALL, **env},
        timeout=600,
    )


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here: it would run")
def test_without_vllm_it_says_so_and_runs_nothing_else_asked(tiny_model_dir, tmp_path):
    done = offline_trials(tiny_model_dir, tmp_path / "out", TARGETS="vllm")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "== vllm: not run: vLLM is not installed" in done.stdout
    assert not (tmp_path / "out" / "vllm").exists() and not (tmp_path / "out" / "profile.json").exists()


@pytest.mark.skipif(vllm_installed(), reason="vLLM is installed here: it would run")
def test_engine_run_and_profile_are_written_and_a_failed_vllm_is_reported(tiny_model_dir, tmp_path):
    stage = tmp_path / "env.sh"  # a staged env that does not provide vLLM: its worker fails
    stage.write_text("export VLLM_STAGED=1\n")
    out = tmp_path / "out"
    done = offline_trials(tiny_model_dir, out, **{VLLM_ENV_VARIABLE: str(stage)})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "vllm failed:" in done.stdout and "cannot import vllm in the worker" in done.stdout
    run = json.loads((out / "engine" / "run.json").read_text())
    assert set(run["offline"]) == {"all", "probes"} and run["offline"]["all"]["completed"] == 2
    assert run["config"]["dtype"] == "float32" and run["config"]["load"]["n_requests"] == 2
    assert "all: 2 of 2 requests" in done.stdout and "probes: one sequence" in done.stdout
    profile = json.loads((out / "profile.json").read_text())
    assert [figures["batch"] for figures in profile["batches"]] == [1, 2]
    assert "decode step:" in done.stdout and not (out / "compare.md").exists()
    # with both targets' runs there (here the engine's twice), a compare table, and nothing run again
    (out / "vllm").mkdir()
    (out / "vllm" / "run.json").write_text(json.dumps({**run, "target": "vllm"}))
    again = offline_trials(tiny_model_dir, out, TARGETS=" ")
    assert again.returncode == 0, again.stdout + again.stderr
    table = (out / "compare.md").read_text()
    assert "| offline all | output_tok_s |" in table and "| offline probes | prefill_tok_s |" in table
    assert "| offline all | output_tok_s |" in again.stdout and "decode step" not in again.stdout


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    done = offline_trials(tmp_path, tmp_path / "out")
    assert done.returncode == 2 and "is not a model folder" in done.stderr

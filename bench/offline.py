"""`bench offline`: a target's step-level engine measured in process, without HTTP, against vLLM's.

`run_offline(config)` starts `python -m bench.offline_worker` in a child process of its own (it
imports the engine or vLLM; bench never does, and each target has the GPU to itself), a staged vLLM
sourced as its server is (bench.launch.sourcing), then summarises the rows the worker wrote with
bench.metrics into the `offline` section, keyed by mode: `all` (every request added at once),
`closed-C` (C in flight) and `probes` (one sequence alone; a batch of long prompts, prefill only).
The CLI's `offline` subcommand and the perf tier's offline case call it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import slowdown
from bench.launch import MAX_MODEL_LEN, sourcing, vllm_env_file, vllm_unavailable_reason
from bench.machine import describe_machine
from bench.metrics import STEP_TIMING, RequestRow, known_figure, probe_figures, summarize
from bench.suite import RUN_FORMAT
from bench.workload import WorkloadSpec

REPO = Path(__file__).resolve().parents[1]  # holds bench/ (and engine/): the worker's working directory
TARGETS = ("engine", "vllm")


@dataclass(frozen=True)
class Probes:
    """The two fixed probes of every run. One sequence: a `single_prompt_len`-token prompt generating
    `single_tokens` tokens alone (its wall time per token after the first). Prefill: `prefill_prompts`
    prompts of `prefill_prompt_len` tokens added at once, `max_tokens` 1 (prompt tokens/s). A count of
    0 skips a probe; smaller sizes are for CPU smoke runs."""

    single_prompt_len: int = 16
    single_tokens: int = 512
    prefill_prompts: int = 64
    prefill_prompt_len: int = 4096

    def __post_init__(self) -> None:
        if min(dataclasses.astuple(self)) < 0:
            raise ValueError(f"probe sizes must be >= 0, got {self}")
        if self.single_tokens and self.single_tokens < 2:
            raise ValueError(
                "the one-sequence probe needs at least 2 tokens (time per token after the first)"
            )
        if (self.single_tokens and self.single_prompt_len < 1) or (
            self.prefill_prompts and self.prefill_prompt_len < 1
        ):
            raise ValueError("a probe that runs needs a prompt of at least 1 token")


@dataclass(frozen=True)
class OfflineLoad:
    """What one offline run measures after `warmup` requests (the workload under the next seed, all at
    once, kept out of every figure): `n_requests` of the workload all at once (0 skips it), an
    in-process closed loop at each of `concurrencies` (new requests for `duration_s` seconds), then
    the probes."""

    n_requests: int = 1000
    concurrencies: tuple[int, ...] = ()
    duration_s: float = 30.0
    warmup: int = 16
    probes: Probes = field(default_factory=Probes)

    def __post_init__(self) -> None:
        if self.n_requests < 0 or self.warmup < 0:
            raise ValueError("n_requests and warmup must be >= 0")
        if any(c < 1 for c in self.concurrencies):
            raise ValueError(f"concurrencies must be >= 1, got {self.concurrencies}")
        if self.concurrencies and not self.duration_s > 0:
            raise ValueError(f"the closed loop needs a duration > 0 s, got {self.duration_s}")


@dataclass(frozen=True)
class OfflineConfig:
    """One target on one model. `dtype`, `max_model_len` and `seed` are the target's options, the same
    the perf tier starts its server with (bench.launch.target_args); the workload has its own seed.
    `options`: more of the target's engine options by name (its EngineArgs fields, e.g.
    max_num_batched_tokens or max_num_seqs, which both targets name alike), to measure a setting."""

    target: str
    model_dir: str
    dtype: str = "bfloat16"
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    load: OfflineLoad = field(default_factory=OfflineLoad)
    max_model_len: int = MAX_MODEL_LEN
    seed: int = 0
    options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r} ({' or '.join(TARGETS)})")
        fixed = {"model", "dtype", "max_model_len", "seed"} & set(self.options)
        if fixed:
            raise ValueError(f"options {sorted(fixed)} have their own flags (--model, --dtype, ...)")

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class OfflineError(RuntimeError):
    """The run could not be made (vLLM missing, the worker failed); the message says why."""


@dataclass
class OfflineRun:
    """What one run measured: the `offline` section (mode -> flat figures), every request's row, and
    what the worker said about the target (name, version, options in force, load and warm-up time)."""

    section: dict[str, dict[str, Any]]
    rows: list[RequestRow]
    worker: dict[str, Any]


def worker_command(config: OfflineConfig, config_path: Path, result_path: Path) -> list[str]:
    """The child's command line; vLLM's through $PERF_VLLM_ENV when that is set, as its server's."""
    command = slowdown.wrap(
        [sys.executable, "-m", "bench.offline_worker", str(config_path), str(result_path)], config.target
    )
    return sourcing(vllm_env_file() if config.target == "vllm" else None, command)


def run_offline(
    config: OfflineConfig, log_path: str | Path | None = None, timeout_s: float | None = None
) -> OfflineRun:
    """Run the worker and summarise what it measured. The worker's output goes to `log_path` (else to
    this process's stdout and stderr). Raises OfflineError with the reason when it cannot run or fails."""
    if config.target == "vllm" and (reason := vllm_unavailable_reason()):
        raise OfflineError(reason)
    with tempfile.TemporaryDirectory(prefix="bench-offline-") as folder:
        config_path, result_path = Path(folder) / "config.json", Path(folder) / "result.json"
        config_path.write_text(json.dumps(config.as_json()))
        command = worker_command(config, config_path, result_path)
        if log_path is None:
            returncode = _run_child(command, None, timeout_s)
        else:
            Path(log_path).parent.mkdir(parents=True, exist_ok=True)
            with Path(log_path).open("wb") as log:
                returncode = _run_child(command, log, timeout_s)
        if returncode != 0 or not result_path.is_file():
            where = f":\n{_tail(log_path)}" if log_path is not None else " (its output is above)"
            raise OfflineError(f"the {config.target} offline worker exited with status {returncode}{where}")
        result = json.loads(result_path.read_text())
    section, rows = summarize_worker(result, config.target)
    worker = {key: value for key, value in result.items() if key not in ("modes", "probes")}
    return OfflineRun(section, rows, worker)


def _run_child(command: list[str], log: Any, timeout_s: float | None) -> int:
    """Run in a process session of its own and, whatever happens, end that session's processes after
    it: vLLM's engine core is a process of its own, and must not outlive the run holding the GPU."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    process = subprocess.Popen(
        command, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True
    )
    try:
        return process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        raise OfflineError(
            f"the offline worker was still running after {timeout_s:.0f} s; stopped it"
        ) from exc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _tail(path: str | Path, lines: int = 40) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def offline_key(mode: str, concurrency: int | None = None) -> str:
    """The section's key of a mode: `all`, `closed-8`, `probes`."""
    return f"closed-{concurrency}" if mode == "closed" else mode


def summarize_worker(
    result: Mapping[str, Any], target: str
) -> tuple[dict[str, dict[str, Any]], list[RequestRow]]:
    """The worker's rows -> the `offline` section and the rows (their `target` filled in).

    A mode's entry: its `mode` (and `concurrency`), bench.metrics.summarize of its rows (the HTTP
    levels' keys), `steps` it took, `step_ms` (mean wall time of one step, measured around the
    target's step()), for the engine its phases `step_<phase>_ms` (engine.step_timing), and where the
    target's cache looked any up, its tokens looked up and found in that mode alone
    (`prefix_cache_queries`, `_hits`, `_hit_rate`: the HTTP levels' names). The `probes` entry holds
    bench.metrics.probe_figures."""
    section: dict[str, dict[str, Any]] = {}
    all_rows: list[RequestRow] = []

    def rows_of(mode: Mapping[str, Any]) -> list[RequestRow]:
        rows = [RequestRow(**{**record, "target": target}) for record in mode["rows"]]
        all_rows.extend(rows)
        return rows

    for mode in result.get("modes", []):
        rows = rows_of(mode)
        cache = mode.get("prefix_cache") or {}  # none looked up (the cache off): no such keys
        cache = cache if cache.get("queries") else {}
        section[offline_key(mode["mode"], mode["concurrency"])] = {
            "mode": mode["mode"],
            "concurrency": mode["concurrency"],
            **summarize(rows),
            "steps": mode["steps"],
            "step_ms": mode["step_ms"],
            **mode["step_timing"],
            **{f"prefix_cache_{key}": value for key, value in cache.items() if value is not None},
        }
    probes = result.get("probes") or {}
    if probes:
        single = rows_of(probes["single"]) if "single" in probes else []
        prefill = rows_of(probes["prefill"]) if "prefill" in probes else []
        section["probes"] = {"mode": "probes", **probe_figures(single, prefill)}
        section["probes"]["failures"] = sum(not row.ok for row in single + prefill)
    return section, all_rows


def run_json(config: OfflineConfig, run: OfflineRun, started_at: str, finished_at: str) -> dict[str, Any]:
    """run.json of `bench offline`: as `bench run`'s (format, target, model, config, warnings, levels,
    here empty), with the machine, what the worker loaded, and the `offline` section."""
    failed = failed_entries(run.section)
    return {
        "format": RUN_FORMAT,
        "kind": "offline",
        "target": config.target,
        "model": config.model_dir,
        "started_at": started_at,
        "finished_at": finished_at,
        "config": config.as_json(),
        "machine": describe_machine(),
        "worker": run.worker,
        "client": {"python": platform.python_version(), "platform": platform.platform(), "argv": sys.argv},
        "warnings": [f"requests failed in {key}" for key in failed],
        "levels": [],
        "offline": run.section,
    }


def describe_entry(key: str, entry: Mapping[str, Any]) -> str:
    """One line for the terminal, from a run's entry or a perf summary's (median) one."""

    def ms(value: Any) -> str:
        return f"{value * 1e3:.2f} ms" if known_figure(value) else "-"

    if key == "probes":
        parts = []
        if "single_tpot_s" in entry:
            parts.append(
                f"one sequence: {ms(entry['single_tpot_s'])} per token after the first "
                f"(TTFT {ms(entry.get('single_ttft_s'))})"
            )
        if "prefill_tok_s" in entry:
            parts.append(f"prefill: {_number(entry['prefill_tok_s'])} prompt tok/s")
        return "probes: " + "; ".join(parts)
    count = f"{entry['completed']} of {entry['n_requests']} requests, " if "n_requests" in entry else ""
    phases = ", ".join(
        f"{name.removeprefix('step_').removesuffix('_ms')} {value:.2f}"
        for name, value in entry.items()
        if name != "step_ms" and STEP_TIMING.match(name) and known_figure(value)
    )
    steps = f"{entry['steps']} steps of " if "steps" in entry else "step "
    step = f"{steps}{_number(entry.get('step_ms'))} ms" + (f" ({phases})" if phases else "")
    hit_rate = entry.get("prefix_cache_hit_rate")
    hits = f"; prefix cache hit rate {hit_rate:.3f}" if known_figure(hit_rate) else ""
    return (
        f"{key}: {count}{_number(entry.get('served_req_s'))} req/s, "
        f"{_number(entry.get('output_tok_s'))} output tok/s, TTFT p50 {ms(entry.get('ttft_p50_s'))}, "
        f"TPOT p50 {ms(entry.get('tpot_p50_s'))}; {step}{hits}; failures {entry.get('failures', 0):g}"
    )


def _number(value: Any) -> str:
    if not known_figure(value):
        return "-"
    return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"


def failed_entries(section: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The keys of entries in which some request failed."""
    return [key for key, entry in section.items() if entry.get("failures")]

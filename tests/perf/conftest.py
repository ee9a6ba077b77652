"""The perf tier's machinery: settings from the command line, the server under test, the recorder.

`pytest -m perf` measures each target (`--target engine|vllm|both`; both = vLLM first, then the
engine, on the same machine) with bench's seed-mix workload. Each target's offline case runs first,
in a child process (`bench offline`), before its server starts; then a session fixture starts the
target's server once (or uses one already running: `--server-url`, or `--server-info` from `python -m
bench serve`), warms it up, and always stops it. The recorder keeps every
trial's figures, checks budgets (tests/perf/budgets.toml) against the reference, and at the end writes
one summary JSON per target (and, with --save-baseline, stores it under baselines/<gpu>/<model>/).
Against a stored reference from another machine the budgets are judged only where bench.budgets.
judged_here says they hold across machines (vLLM's); otherwise each figure is shown with its ratio
and budget, and only a failed request, a missing figure or one that is not a finite number fails.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.budgets import (
    BudgetCheck,
    judged_here,
    load_budgets,
    may_store_baseline,
    shown_only,
    tally,
)
from bench.client import Endpoint
from bench.launch import (
    ServerProcess,
    ServerSpec,
    load_server_info,
    redact_args,
    vllm_unavailable_reason,
)
from bench.machine import describe_machine, same_machine
from bench.offline import describe_entry
from bench.probe import first_model, probe
from bench.profiles import PROFILES, Profile
from bench.report import write_report
from bench.runner import run_closed_loop
from bench.trials import summarize_trials
from bench.workload import WorkloadSpec

REPO = Path(__file__).resolve().parents[2]
BUDGETS_FILE = Path(__file__).with_name("budgets.toml")
# Switches read from the environment (the tier's command-line options live in the root conftest.py):
# PERF_REQUIRE_REFERENCE=1: no reference for this GPU and model fails the case (with what to do)
# instead of skipping it, so a CI job cannot be green having checked nothing (perf.yml sets it).
# PERF_FORCE_SAVE=1: --save-baseline stores the run even when its budgets or cases failed.
REQUIRE_REFERENCE = "PERF_REQUIRE_REFERENCE"
FORCE_SAVE = "PERF_FORCE_SAVE"


def _switch(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


SEED_MIX = WorkloadSpec(kind="seed-mix", seed=0)


@dataclass
class PerfSettings:
    machine: dict[str, Any]
    model: str  # preset name or folder, as given
    profile: Profile
    trials: int
    targets: list[str]
    server_url: str | None
    server_infos: dict[str, dict[str, Any]]  # target -> description written by `bench serve`
    baseline: str | None
    save_baseline: bool
    out: Path
    workload: WorkloadSpec = SEED_MIX

    @property
    def gpu(self) -> bool:
        return self.machine["gpu"] is not None

    @property
    def model_key(self) -> str:
        return Path(self.model).name

    @property
    def dtype(self) -> str:
        return "bfloat16" if self.gpu else "float32"

    def baseline_dir(self) -> Path:
        return REPO / "baselines" / self.machine["gpu_slug"] / self.model_key


def settings(config: pytest.Config) -> PerfSettings:
    cached = getattr(config, "_perf_settings", None)
    if cached is not None:
        return cached
    import engine

    machine = describe_machine(engine.__version__)
    gpu = machine["gpu"] is not None
    target = config.getoption("--target")
    server_url = config.getoption("--server-url")
    if server_url and target == "both":
        raise pytest.UsageError(
            "--server-url measures one running server: use --target engine or vllm with it"
        )
    server_infos: dict[str, dict[str, Any]] = {}
    for path in config.getoption("--server-info"):
        try:
            info = load_server_info(path)
        except ValueError as exc:
            raise pytest.UsageError(str(exc)) from exc
        if info["target"] in server_infos:
            raise pytest.UsageError(f"--server-info: two descriptions of a {info['target']} server")
        server_infos[str(info["target"])] = info
    targets = ["vllm", "engine"] if target == "both" else [target]
    if unmeasured := sorted(set(server_infos) - set(targets)):
        raise pytest.UsageError(f"--server-info describes {unmeasured}, not measured with --target {target}")
    if server_url and server_infos:
        raise pytest.UsageError("--server-url and --server-info both name the server: give one")
    result = PerfSettings(
        machine=machine,
        model=config.getoption("--model") or ("qwen2.5-1.5b" if gpu else "tiny"),
        profile=PROFILES[config.getoption("--profile") or ("full" if gpu else "smoke")],
        trials=config.getoption("--trials") or (3 if gpu else 1),
        targets=targets,
        server_url=server_url,
        server_infos=server_infos,
        baseline=config.getoption("--baseline"),
        save_baseline=config.getoption("--save-baseline"),
        out=Path(config.getoption("--perf-out")),
    )
    config._perf_settings = result  # type: ignore[attr-defined]
    return result


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    perf = settings(metafunc.config)
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", perf.targets, scope="session")
    if "concurrency" in metafunc.fixturenames:
        metafunc.parametrize("concurrency", perf.profile.concurrencies)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """All cases of one target, then all of the next (vLLM first with --target both): the session's
    server is then started once per target, never twice. Within a target, cases that do not use the
    server (the offline case) come first, before it starts."""
    order = {target: i for i, target in enumerate(settings(config).targets)}

    def key(item: pytest.Item) -> tuple[int, bool]:
        callspec = getattr(item, "callspec", None)
        target = order.get(callspec.params.get("target"), -1) if callspec else -1
        return (target, "server" in getattr(item, "fixturenames", ()))

    items.sort(key=key)


@pytest.fixture(scope="session")
def perf(pytestconfig: pytest.Config) -> PerfSettings:
    return settings(pytestconfig)


def model_dir(perf: PerfSettings) -> str:
    """A folder as given, or the preset's synthetic checkpoint (written once under perf-out/models)."""
    if Path(perf.model).is_dir():
        return str(Path(perf.model).resolve())
    from engine.synthetic import PRESETS, write_checkpoint

    if perf.model not in PRESETS:
        raise pytest.UsageError(
            f"--model {perf.model!r} is neither a folder nor a preset ({sorted(PRESETS)})"
        )
    folder = (perf.out / "models" / perf.model).resolve()
    if not (folder / "config.json").is_file():
        write_checkpoint(perf.model, folder, dtype="bfloat16")
    return str(folder)


@pytest.fixture(scope="session")
def model_folder(perf: PerfSettings) -> Callable[[], str]:
    """The model folder, found or written when called: a preset's checkpoint is written then (2.9 GB
    for qwen2.5-1.5b), which a case that skips (a running server holds the GPU) must not pay for."""
    return functools.partial(model_dir, perf)


# -- the recorder ----------------------------------------------------------------------------------
@dataclass
class TargetRecord:
    target: str
    header: dict[str, Any]
    sweep_trials: list[dict[str, Any]] = field(default_factory=list)
    closed_trials: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    offline_trials: list[dict[str, Any]] = field(default_factory=list)  # each trial's offline section
    checks: list[BudgetCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    server_started: bool = False

    @property
    def measured(self) -> bool:
        return bool(self.sweep_trials or self.closed_trials or self.offline_trials)

    def summary(self, trials: int) -> dict[str, Any]:
        closed = [
            [levels[i] for levels in self.closed_trials.values() if i < len(levels)] for i in range(trials)
        ]
        return summarize_trials(
            header=self.header,
            sweep_trials=self.sweep_trials,
            closed_trials=closed,
            trials=trials,
            offline_trials=self.offline_trials,
        )


@dataclass
class Reference:
    summary: dict[str, Any]
    source: str
    same_machine: bool
    same_run: bool = False  # vLLM measured in this session

    @property
    def target(self) -> str:
        return str(self.summary.get("target"))


class Recorder:
    def __init__(self, perf: PerfSettings) -> None:
        self.perf = perf
        self.records: dict[str, TargetRecord] = {}
        self.budgets = load_budgets(BUDGETS_FILE)
        self.servers: dict[str, ServerProcess] = {}  # servers this session started, by target

    def record(self, target: str) -> TargetRecord:
        """The target's record, made on first use (by its offline case, else its server) with what
        every summary says; the server fixture adds what it learns from the server."""
        if target not in self.records:
            perf = self.perf
            self.records[target] = TargetRecord(
                target,
                header={
                    "target": target,
                    "version": None,
                    "gpu": perf.machine["gpu"],
                    "model": perf.model_key,
                    "dtype": perf.dtype,
                    "workload": "seed-mix",
                    "profile": perf.profile.name,
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "machine": perf.machine,
                },
            )
        return self.records[target]

    def stop_servers(self) -> None:
        """Stop every server this session started (an offline case wants the GPU to itself; with
        --target both, vLLM's server is still up when the engine's offline case starts)."""
        for process in self.servers.values():
            process.stop()

    def reference_for(self, target: str) -> Reference | None:
        """vLLM measured in this session, else --baseline, else the stored vLLM result, else the stored
        engine result for this GPU and model. None when there is none (or when vLLM is the target)."""
        if target == "vllm":
            return None
        vllm = self.records.get("vllm")
        if vllm is not None and vllm.measured:
            return Reference(
                self.records["vllm"].summary(self.perf.trials), "vLLM measured in this session", True, True
            )
        candidates = (
            [Path(self.perf.baseline)]
            if self.perf.baseline
            else [self.perf.baseline_dir() / f"{name}-seed-mix.json" for name in ("vllm", "engine")]
        )
        for path in candidates:
            if path.is_file():
                summary = json.loads(path.read_text())
                shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                # Lent machines can share GPU, CPU model, core count and host name (same_machine tells
                # them apart by their boot): a stored file is always named with its date and profile,
                # so a reader can tell it from a same-run ratio.
                source = f"stored {shown} ({summary.get('profile')} profile, {summary.get('trials')} trial(s), {summary.get('date')})"
                return Reference(summary, source, same_machine(summary.get("machine"), self.perf.machine))
        return None

    def check(self, target: str, checks_for, section: str | None = None) -> None:
        """Assert budgets against the reference, where they can be judged here (`judged_here`: the
        reference was measured on this machine, or is vLLM's, whose budgets allow for the spread
        between hosts); else only show them, and fail only on a broken figure (missing, or not a
        finite number), or, with PERF_REQUIRE_REFERENCE=1, for having judged nothing. Skips, saying
        why, when there is nothing to hold to (no reference, no budgets against it, or a reference
        without the `section` these figures need)."""
        record = self.records[target]
        self.write(final=False)
        if target == "vllm":
            return  # vLLM is the reference: measured and recorded, nothing to hold it to
        reference = self.reference_for(target)
        if reference is None:
            self.nothing_to_hold(
                f"no baseline for {self.perf.machine['gpu_slug']}/{self.perf.model_key} (looked in "
                f"{self.perf.baseline_dir().relative_to(REPO)}): figures recorded, budgets not checked. "
                "Measure vLLM in the same run (--target both), or store a reference on this GPU "
                "(pytest -m perf --target vllm --save-baseline) and commit it"
            )
            return
        budgets = self.budgets.get(reference.target)
        if not budgets:
            self.nothing_to_hold(
                f"{BUDGETS_FILE.name} has no budgets against a {reference.target!r} reference"
            )
            return
        if section is not None and not reference.summary.get(section):
            # a named skip even under PERF_REQUIRE_REFERENCE: the HTTP cases still hold the run
            pytest.skip(f"the reference, {reference.source}, has no {section} figures: recorded, not checked")
        checks = checks_for(reference.summary, budgets)
        judged = judged_here(reference.target, reference.same_machine)
        if not judged:
            checks = shown_only(checks)
        record.checks += checks
        note = f"against {reference.source}{_machine_flag(reference, judged)}"
        if note not in record.notes:
            record.notes.append(note)
        failed = [c.describe() for c in checks if c.failed]
        assert not failed, f"{'budgets missed' if judged else 'broken figures'} {note}:\n" + "\n".join(failed)
        if not judged and _switch(REQUIRE_REFERENCE):
            pytest.fail(
                f"the reference, {reference.source}, was measured on another machine: its budgets are "
                f"shown, not judged ({REQUIRE_REFERENCE}=1: a case that judged nothing fails). Measure "
                "vLLM in the same run (--target both), or store a reference on this machine",
                pytrace=False,
            )

    def nothing_to_hold(self, why: str) -> None:
        """No reference or no budgets: a skip, or with PERF_REQUIRE_REFERENCE=1 a failure."""
        if _switch(REQUIRE_REFERENCE):
            pytest.fail(
                f"{why} ({REQUIRE_REFERENCE}=1: a case with nothing to hold it to fails)", pytrace=False
            )
        pytest.skip(why)

    def write(self, final: bool = True, failed_cases: int = 0) -> list[Path]:
        """One summary JSON per measured target; with --save-baseline, also under baselines/, unless
        its budgets or cases failed (PERF_FORCE_SAVE=1 stores it anyway); the report shows each stored
        reference a target was held to beside the run.

        Called after every case too (final=False), so a run cut short still leaves its figures."""
        written = []
        for target, record in self.records.items():
            if not record.measured:
                continue
            summary = record.summary(self.perf.trials)
            path = self.perf.out / f"{target}-seed-mix.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(summary, indent=2, allow_nan=False, default=_no_nan) + "\n")
            written.append(path)
            if self.perf.save_baseline and final:
                refused = may_store_baseline(record.checks, failed_cases, _switch(FORCE_SAVE))
                if refused:
                    record.notes.append(f"{refused} (PERF_FORCE_SAVE=1)")
                    continue
                stored = self.perf.baseline_dir() / path.name
                stored.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, stored)
                record.notes.append(f"stored as {stored.relative_to(REPO)}")
        if written and final:
            write_report([*written, *self.stored_references()], self.perf.out / "report.html")
        return written

    def stored_references(self) -> list[Path]:
        """The stored files the measured targets were held to (not a vLLM of this same run, which the
        report shows already), labelled as references in a copy under --perf-out."""
        paths = []
        for target, record in self.records.items():
            reference = self.reference_for(target) if record.measured else None
            if reference is None or reference.same_run:
                continue
            labelled = dict(
                reference.summary, target=f"reference: {reference.target} ({reference.summary.get('date')})"
            )
            path = self.perf.out / f"reference-for-{target}.json"
            path.write_text(json.dumps(labelled, indent=2) + "\n")
            paths.append(path)
        return paths


def _machine_flag(reference: Reference, judged: bool) -> str:
    """What the output says about the machine a reference was measured on, and what that means here."""
    if reference.same_machine:
        return ""
    if judged:
        return (
            " [reference measured on another machine: judged, its budgets allow for the spread between "
            "hosts; --target both measures vLLM on this one]"
        )
    return (
        " [reference measured on another machine: timings shown with their ratios, not judged; failed "
        "requests, missing figures and figures that are not finite numbers still fail]"
    )


def _no_nan(value: object) -> object:
    raise TypeError(f"not JSON serializable: {value!r}")


@pytest.fixture(scope="session")
def recorder(perf: PerfSettings, pytestconfig: pytest.Config, request: pytest.FixtureRequest):
    rec = Recorder(perf)
    pytestconfig._perf_recorder = rec  # type: ignore[attr-defined]
    yield rec
    rec.write(failed_cases=request.session.testsfailed)


# -- the server under test -------------------------------------------------------------------------
@dataclass
class ServerUnderTest:
    target: str
    endpoint: Endpoint


@pytest.fixture(scope="session")
def server(target: str, perf: PerfSettings, recorder: Recorder):
    """Start the target's server (or use --server-url), describe it, warm it up; always stop it."""
    process = None
    ready_after_s = None
    try:
        if info := perf.server_infos.get(target):
            base_url, server_args = str(info["base_url"]).rstrip("/"), list(info["args"])
            ready_after_s = info.get("ready_after_s")
        elif perf.server_url:
            base_url, server_args = perf.server_url.rstrip("/"), []
        else:
            if target == "vllm" and (reason := vllm_unavailable_reason()):
                pytest.skip(reason)
            folder = model_dir(perf)
            spec = ServerSpec.for_target(target, folder, perf.dtype)
            server_args = spec.args
            process = ServerProcess(spec, perf.out / f"{target}-server.log")
            recorder.servers[target] = process
            process.start(timeout_s=300.0 if target == "vllm" else 180.0)
            base_url, ready_after_s = spec.base_url, process.ready_after_s
        api_key = os.environ.get("OPENAI_API_KEY")  # as bench's --api-key default: a server with --api-key
        endpoint = Endpoint(
            base_url=base_url, model=first_model(base_url, api_key), target=target, api_key=api_key
        )
        described = probe(endpoint)
        body = (described.get("server") or {}).get("body") or {}  # type: ignore[union-attr]
        record = recorder.record(target)
        if record.server_started:
            raise RuntimeError(
                f"the {target} server was started twice in one session: its cases were not grouped"
            )
        record.server_started = True
        record.header.update(
            {
                "version": body.get("version") if isinstance(body, dict) else record.header["version"],
                "dtype": "bfloat16"
                if perf.gpu
                else (body.get("config", {}).get("dtype") if isinstance(body, dict) else None),
                "server_args": redact_args(server_args),
                "server": described.get("server"),
                "server_ready_s": ready_after_s,
            }
        )
        # Warm-up, kept out of every figure: a first trial on a cold server ran 7% high on the H200.
        run_closed_loop(
            endpoint,
            WorkloadSpec(kind="seed-mix", seed=1),
            perf.profile.warmup_concurrency,
            perf.profile.warmup,
        )
        yield ServerUnderTest(target, endpoint)
    finally:
        if process is not None:
            process.stop()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    recorder: Recorder | None = getattr(config, "_perf_recorder", None)
    if recorder is None or not recorder.records:
        return
    terminalreporter.section("perf: figures and budgets")
    for target, record in recorder.records.items():
        summary = record.summary(recorder.perf.trials)
        terminalreporter.write_line(
            f"{target}: capacity {summary.get('capacity_req_s')} req/s (still rising: {summary.get('capacity_still_rising')}), {recorder.perf.trials} trial(s), profile {recorder.perf.profile.name}"
        )
        for key, entry in (summary.get("offline") or {}).items():
            terminalreporter.write_line(f"  offline {describe_entry(key, entry)}")
        for level in summary["closed_loop"]:
            terminalreporter.write_line(
                f"  concurrency {level['concurrency']:g}: {level['output_tok_s']:.1f} tok/s (min {level['output_tok_s_min']:.1f}, max {level['output_tok_s_max']:.1f}), TTFT p50 {level['ttft_p50_s']:.3f} s, TPOT p50 {level['tpot_p50_s']:.4f} s"
            )
        for note in record.notes:
            terminalreporter.write_line(f"  {note}")
        for check in record.checks:
            terminalreporter.write_line(f"  {check.describe()}")
        if record.checks:
            terminalreporter.write_line(f"  {tally(record.checks)}")
    terminalreporter.write_line(f"summaries and report under {recorder.perf.out}/")

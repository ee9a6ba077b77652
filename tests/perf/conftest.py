"""The perf tier's machinery: settings from the command line, the server under test, the recorder.

`pytest -m perf` measures each target (`--target engine|vllm|both`; both = vLLM first, then the
engine, on the same machine) with bench's seed-mix workload, in each mode the profile runs (the
sampling modes, greedy and sampled, and the prompt modes, text and chat: the `mode` parameter of every
case, `-k sampled` selects one), and its prefix-cache modes against a server of its own with the cache
on (`cached_server`, after every other case of the target). Each target's
offline cases run first, in a child process (`bench offline`), before its server starts; then a session
fixture starts the target's server once (or uses one already running: `--server-url`, or
`--server-info` from `python -m bench serve`), warms it up in every mode it will serve, and always stops
it. The recorder keeps every trial's figures by target and mode, checks budgets (tests/perf/
budgets.toml, a section per mode) against the reference of the same mode, and at the end writes one
summary JSON per target and mode, `{target}-seed-mix.json` and `{target}-seed-mix-sampled.json` (and,
with --save-baseline, stores them under baselines/<gpu>/<model>/).
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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from bench.budgets import (
    BudgetCheck,
    budget_section,
    judged_here,
    load_budgets,
    may_store_baseline,
    shown_only,
    skipped,
    tally,
)
from bench.client import Endpoint
from bench.launch import (
    CACHE_OFF_FLAG,
    ServerProcess,
    ServerSpec,
    load_server_info,
    redact_args,
    stop_servers_on_sigterm,
    vllm_unavailable_reason,
)
from bench.machine import checkout_engine_version, describe_machine, same_machine
from bench.offline import describe_entry
from bench.probe import first_model, probe
from bench.profiles import PROFILES, Profile, seed_mix
from bench.report import write_report
from bench.runner import SweepConfig, run_closed_loop
from bench.server_metrics import describe_first_token, describe_kernel_compiles
from bench.trials import (
    GREEDY,
    PREFIX_MODES,
    PROMPT_MODES,
    case_mode,
    describe_sampling,
    sampling_header,
    summarize_trials,
    summary_name,
)
from bench.workload import WorkloadSpec

REPO = Path(__file__).resolve().parents[2]
# Switches read from the environment (the tier's command-line options live in the root conftest.py):
# PERF_BUDGETS=FILE: budgets from FILE instead of tests/perf/budgets.toml (a draft of new budgets
# tried on a run before it is reviewed; the tier's own tests).
# PERF_REQUIRE_REFERENCE=1: no reference for this GPU and model fails the case (with what to do)
# instead of skipping it, so a CI job cannot be green having checked nothing (perf.yml sets it).
# PERF_FORCE_SAVE=1: --save-baseline stores the run even when its budgets or cases failed.
REQUIRE_REFERENCE = "PERF_REQUIRE_REFERENCE"
FORCE_SAVE = "PERF_FORCE_SAVE"
BUDGETS_FILE = Path(os.environ.get("PERF_BUDGETS") or Path(__file__).with_name("budgets.toml"))


def _switch(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


@dataclass
class PerfSettings:
    machine: dict[str, Any]
    model: str  # preset name or folder, as given
    profile: Profile
    trials: int
    targets: list[str]
    server_url: str | None
    server_infos: dict[str, dict[str, Any]]  # target -> description written by `bench serve`
    baselines: dict[str, Path]  # mode -> the --baseline file measured in it
    save_baseline: bool
    out: Path

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
    machine = describe_machine(checkout_engine_version())
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
    baselines: dict[str, Path] = {}
    for given in config.getoption("--baseline"):
        try:
            mode = case_mode(json.loads(Path(given).read_text()))
        except (OSError, ValueError) as exc:
            raise pytest.UsageError(f"--baseline {given}: {exc}") from exc
        if mode in baselines:
            raise pytest.UsageError(f"--baseline: {baselines[mode]} and {given} are both {mode}: one a mode")
        baselines[mode] = Path(given)
    result = PerfSettings(
        machine=machine,
        model=config.getoption("--model") or ("qwen2.5-1.5b" if gpu else "tiny"),
        profile=PROFILES[config.getoption("--profile") or ("full" if gpu else "smoke")],
        trials=config.getoption("--trials") or (3 if gpu else 1),
        targets=targets,
        server_url=server_url,
        server_infos=server_infos,
        baselines=baselines,
        save_baseline=config.getoption("--save-baseline"),
        out=Path(config.getoption("--perf-out")),
    )
    config._perf_settings = result  # type: ignore[attr-defined]
    return result


def pytest_configure(config: pytest.Config) -> None:
    """A run ended by SIGTERM (a CI step's time limit, `timeout(1)`) stops the servers it started, as
    Ctrl-C does: they run in sessions of their own and would otherwise hold the GPU after it."""
    stop_servers_on_sigterm()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    """After every case, passed or failed: the summaries written (a failed case's figures and notes
    kept, so a run cut short later still says why it failed). A case interrupted inside its rounds
    (Ctrl-C, SIGTERM) has its benchmark marked as failed: pytest-benchmark would otherwise report
    a benchmark with no rounds at the session's end and crash there (min() of an empty list), losing
    the run's terminal summary."""
    outcome = yield
    excinfo = outcome.excinfo
    if excinfo is not None and issubclass(excinfo[0], KeyboardInterrupt):
        fixture = getattr(item, "funcargs", {}).get("benchmark")
        if fixture is not None:
            fixture.has_error = True
    recorder: Recorder | None = getattr(item.config, "_perf_recorder", None)
    if recorder is not None:
        recorder.write(final=False)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Each case in each mode the profile runs it in (ids `[sampled-4-engine]`, so `-k sampled` selects
    a mode): the closed loop at each of the mode's concurrencies, the sweep only in modes with one (a
    case that asks for `sweep`), the offline case in every sampling mode (it sends no HTTP: the prompt
    modes, text and chat, have nothing to measure there); a case against the server with its prefix
    cache on (`cached_server`) in the prefix-cache modes, and only it."""
    perf = settings(metafunc.config)
    if "mode" in metafunc.fixturenames:
        cached = "cached_server" in metafunc.fixturenames
        modes_here = perf.profile.prefix_modes if cached else perf.profile.modes
        profiles = {mode: perf.profile.for_mode(mode) for mode in modes_here}
        if "concurrency" in metafunc.fixturenames:
            pairs = [(mode, c) for mode, profile in profiles.items() for c in profile.concurrencies]
            metafunc.parametrize(("mode", "concurrency"), pairs, ids=[f"{m}-{c}" for m, c in pairs])
        else:
            wants_sweep = "sweep" in metafunc.fixturenames
            modes = [mode for mode, profile in profiles.items() if profile.sweep or not wants_sweep]
            if "server" not in metafunc.fixturenames:
                modes = [mode for mode in modes if mode in perf.profile.sampling]
            metafunc.parametrize("mode", modes)
    elif "concurrency" in metafunc.fixturenames:
        metafunc.parametrize("concurrency", perf.profile.concurrencies)
    if "target" in metafunc.fixturenames:
        metafunc.parametrize("target", perf.targets, scope="session")


def _params(item: pytest.Item) -> dict[str, Any]:
    callspec = getattr(item, "callspec", None)
    return dict(callspec.params) if callspec else {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """All cases of one target, then all of the next (vLLM first with --target both): the session's
    server is then started once per target, never twice. Within a target, cases that do not use the
    server (the offline cases) come first, before it starts; then the greedy cases, the sampled, and
    the prompt modes'; last the prefix-cache cases, against a server of their own (the cache on)."""
    perf = settings(config)
    order = {target: i for i, target in enumerate(perf.targets)}
    modes = {mode: i for i, mode in enumerate((*perf.profile.modes, *perf.profile.prefix_modes))}

    def key(item: pytest.Item) -> tuple[int, int, int]:
        params = _params(item)
        names = getattr(item, "fixturenames", ())
        stage = 2 if "cached_server" in names else 1 if "server" in names else 0
        return (order.get(str(params.get("target")), -1), stage, modes.get(str(params.get("mode")), -1))

    # A case with no mode in this profile (the smoke runs no prefix-cache mode) is not collected, rather
    # than listed as an empty parameter set.
    unparametrized = [
        item for item in items if "mode" in _params(item) and not isinstance(_params(item)["mode"], str)
    ]
    if unparametrized:
        config.hook.pytest_deselected(items=unparametrized)
        items[:] = [item for item in items if item not in unparametrized]
    items.sort(key=key)


@pytest.fixture(scope="session")
def perf(pytestconfig: pytest.Config) -> PerfSettings:
    return settings(pytestconfig)


@pytest.fixture
def profile(perf: PerfSettings, mode: str) -> Profile:
    """The profile as this case's mode runs it (the smoke's sampled mode runs fewer cases)."""
    return perf.profile.for_mode(mode)


@pytest.fixture
def workload(perf: PerfSettings, mode: str) -> WorkloadSpec:
    """The seed-mix workload in this case's mode: greedy, bench.workload.SAMPLED, or text prompts of
    the model's tokenizer (text, chat)."""
    made = mode_workload(perf, mode)
    if made is None:
        pytest.skip(NO_TOKENIZER.format(mode=mode, model=perf.model))
    return made


NO_TOKENIZER = (
    "the {mode} mode makes its prompts with the model's tokenizer, and --model {model!r} names neither a "
    "folder nor a preset: give the model's folder"
)


def mode_workload(perf: PerfSettings, mode: str, seed: int = 0) -> WorkloadSpec | None:
    """The seed-mix workload in `mode`; a prompt mode's text is made with the model's tokenizer (None
    when there is none to load)."""
    if mode not in PROMPT_MODES:
        return seed_mix(mode, seed=seed)
    tokenizer = tokenizer_dir(perf)
    return None if tokenizer is None else seed_mix(mode, seed=seed, tokenizer=tokenizer)


@pytest.fixture
def sweep(profile: Profile) -> SweepConfig:
    """The sweep of this case's mode (the sweep case is generated only for modes that have one)."""
    assert profile.sweep is not None
    return profile.sweep


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


def tokenizer_dir(perf: PerfSettings) -> str | None:
    """The folder whose tokenizer makes the prompt modes' text: the model folder given, the one a
    --server-info server serves, or a preset's written checkpoint; for a preset under --server-url
    (whose checkpoint nothing else needs), the preset's tokenizer alone, written once under
    perf-out/tokenizers. None when --model names neither a folder nor a preset."""
    if Path(perf.model).is_dir():
        return str(Path(perf.model).resolve())
    for info in perf.server_infos.values():
        served = info.get("model_dir")
        if isinstance(served, str) and Path(served).is_dir():
            return served
    from engine.synthetic import PRESETS, write_tokenizer

    if perf.model not in PRESETS:
        return None
    checkpoint = (perf.out / "models" / perf.model).resolve()
    if (checkpoint / "config.json").is_file() or not perf.server_url:
        return model_dir(perf)
    folder = (perf.out / "tokenizers" / perf.model).resolve()
    if not (folder / "tokenizer.json").is_file():
        folder.mkdir(parents=True, exist_ok=True)
        write_tokenizer(folder, PRESETS[perf.model])
    return str(folder)


@pytest.fixture(scope="session")
def model_folder(perf: PerfSettings) -> Callable[[], str]:
    """The model folder, found or written when called: a preset's checkpoint is written then (2.9 GB
    for qwen2.5-1.5b), which a case that skips (a running server holds the GPU) must not pay for."""
    return functools.partial(model_dir, perf)


# -- the recorder ----------------------------------------------------------------------------------
@dataclass
class TargetRecord:
    """One target's figures in one mode: one summary file, one reference, one budget section."""

    target: str
    mode: str
    header: dict[str, Any]
    sweep_trials: list[dict[str, Any]] = field(default_factory=list)
    closed_trials: dict[int, list[dict[str, Any]]] = field(default_factory=dict)
    offline_trials: list[dict[str, Any]] = field(default_factory=list)  # each trial's offline section
    checks: list[BudgetCheck] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def summary_name(self) -> str:
        return summary_name(self.target, self.mode)

    @property
    def title(self) -> str:
        """How the terminal names it: `engine`, `engine, sampled (temperature 1, top_p 0.95)`, `engine,
        text prompts`, `engine, chat completions`."""
        if self.mode == GREEDY:
            return self.target
        if self.mode in PROMPT_MODES:
            return f"{self.target}, {'chat completions' if self.mode == 'chat' else 'text prompts'}"
        if self.mode in PREFIX_MODES:
            return f"{self.target}, {self.mode} (prefix cache on)"
        return f"{self.target}, {describe_sampling(self.header['temperature'], self.header['top_p'])}"

    @property
    def measured(self) -> bool:
        return bool(self.sweep_trials or self.closed_trials or self.offline_trials)

    def summary(self, trials: int) -> dict[str, Any]:
        """The folded trials, and the notes the terminal shows (failed requests, the hit rates, the
        client's lag), so a summary read alone says what the run saw."""
        closed = [
            [levels[i] for levels in self.closed_trials.values() if i < len(levels)] for i in range(trials)
        ]
        summary = summarize_trials(
            header=self.header,
            sweep_trials=self.sweep_trials,
            closed_trials=closed,
            trials=trials,
            offline_trials=self.offline_trials,
        )
        if self.notes:
            summary["notes"] = list(dict.fromkeys(self.notes))
        return summary


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
        self.records: dict[tuple[str, str], TargetRecord] = {}  # by (target, mode)
        self.budgets = load_budgets(BUDGETS_FILE)
        self.servers: dict[str, ServerProcess] = {}  # servers this session started, by target
        self.served: set[str] = set()  # targets whose server fixture ran: it must run once

    def record(self, target: str, mode: str) -> TargetRecord:
        """The target's record in a mode, made on first use (by its offline case, else its
        server) with what every summary says; the server fixture adds what it learns from the server."""
        if (target, mode) not in self.records:
            perf = self.perf
            self.records[target, mode] = TargetRecord(
                target,
                mode,
                header={
                    "target": target,
                    "version": None,
                    "gpu": perf.machine["gpu"],
                    "model": perf.model_key,
                    "dtype": perf.dtype,
                    "workload": "seed-mix",
                    **sampling_header(mode),
                    "profile": perf.profile.name,
                    "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                    "machine": perf.machine,
                },
            )
        return self.records[target, mode]

    def stop_servers(self) -> None:
        """Stop every server this session started (an offline case wants the GPU to itself; with
        --target both, vLLM's server is still up when the engine's offline case starts)."""
        for process in self.servers.values():
            process.stop()

    def stored_candidates(self, mode: str) -> list[Path]:
        """Where a stored reference for `mode` is looked for: the stored vLLM result, then the
        stored engine result for this GPU and model, in that mode's files."""
        return [self.perf.baseline_dir() / summary_name(name, mode) for name in ("vllm", "engine")]

    def reference_for(self, target: str, mode: str) -> Reference | None:
        """For figures in `mode`: vLLM measured in this session in that mode, else the --baseline
        measured in that mode, else the stored vLLM result, else the stored engine result for this GPU
        and model, in that mode. None when there is none (or when vLLM is the target)."""
        if target == "vllm":
            return None
        vllm = self.records.get(("vllm", mode))
        if vllm is not None and vllm.measured:
            return Reference(vllm.summary(self.perf.trials), "vLLM measured in this session", True, True)
        given = self.perf.baselines.get(mode)
        for path in [given] if given else self.stored_candidates(mode):
            if path.is_file():
                summary = json.loads(path.read_text())
                shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
                # Lent machines can share GPU, CPU model, core count and host name (same_machine tells
                # them apart by their boot): a stored file is always named with its date and profile,
                # so a reader can tell it from a same-run ratio.
                source = f"stored {shown} ({summary.get('profile')} profile, {summary.get('trials')} trial(s), {summary.get('date')})"
                return Reference(summary, source, same_machine(summary.get("machine"), self.perf.machine))
        return None

    def check(self, target: str, mode: str, checks_for, section: str | None = None) -> None:
        """Assert budgets against the reference of this mode, where they can be judged here
        (`judged_here`: the reference was measured on this machine, or is vLLM's, whose budgets allow
        for the spread between hosts); else only show them, and fail only on a broken figure (missing,
        or not a finite number), or, with PERF_REQUIRE_REFERENCE=1, for having judged nothing. Skips,
        saying why, when there is nothing to hold to (no reference in this mode, no budget section for
        it, or a reference without the `section` these figures need)."""
        record = self.records[target, mode]
        if target == "vllm":
            return  # vLLM is the reference: measured and recorded, nothing to hold it to
        reference = self.reference_for(target, mode)
        if reference is None:
            self.nothing_to_hold(self.no_reference(mode))
            return
        name = budget_section(reference.target, mode)
        budgets = self.budgets.get(name)
        if not budgets:
            # Each check the greedy budgets would make, skipped by name; then the case skips.
            template = self.budgets.get(reference.target) if mode != GREEDY else None
            why = f"{BUDGETS_FILE.name} has no [{name}] budgets"
            named = checks_for(reference.summary, template) if template else []
            record.checks += [skipped(check.level, check.metric, why) for check in named]
            self.nothing_to_hold(
                f"{why} against a {reference.target!r} reference ({reference.source}): figures recorded, "
                f"not checked. Add a [{name}] section (and its per-level tables, [{name}.output_tok_s] ...) "
                "set from measured ratios, as the greedy sections are"
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

    def no_reference(self, mode: str) -> str:
        """Why a case has no reference in this mode, and exactly how to store one."""
        looked = ", ".join(str(path.relative_to(REPO)) for path in self.stored_candidates(mode))
        store = f"pytest -m perf tests/perf --target vllm -k {mode} --save-baseline"
        return (
            f"no baseline for {self.perf.machine['gpu_slug']}/{self.perf.model_key} ({mode}: looked for "
            f"{looked}): figures recorded, budgets not checked. Measure vLLM in the same run (--target "
            f"both), or store a reference on this GPU ({store}; several trials: scripts/perf_trials.sh "
            f'with PERF_K={mode}, then bench merge, README "Performance tier") and commit it'
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

        Called after every case too, passed or failed (final=False, by pytest_runtest_call), so a run
        cut short still leaves its figures."""
        written = []
        for record in self.records.values():
            if not record.measured:
                continue
            summary = record.summary(self.perf.trials)
            path = self.perf.out / record.summary_name
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
        for record in self.records.values():
            reference = self.reference_for(record.target, record.mode) if record.measured else None
            if reference is None or reference.same_run:
                continue
            labelled = dict(
                reference.summary, target=f"reference: {reference.target} ({reference.summary.get('date')})"
            )
            path = self.perf.out / f"reference-for-{record.summary_name}"
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


def modes_served(items: list[pytest.Item], target: str, fixture: str = "server") -> list[str]:
    """The modes of this session's cases against `target`'s server (`fixture`: `server`, or
    `cached_server`, the one with its prefix cache on), in the profile's order (greedy when none says)."""
    modes = [
        _params(item).get("mode", GREEDY)
        for item in items
        if fixture in getattr(item, "fixturenames", ()) and _params(item).get("target") == target
    ]
    return list(dict.fromkeys(modes)) or [GREEDY]


@pytest.fixture(scope="session")
def server(target: str, perf: PerfSettings, recorder: Recorder, request: pytest.FixtureRequest):
    """Start the target's server (or use --server-url), describe it, warm it up in each mode its cases
    use; always stop it."""
    yield from _serve(target, perf, recorder, request, cached=False)


@pytest.fixture(scope="session")
def cached_server(target: str, perf: PerfSettings, recorder: Recorder, request: pytest.FixtureRequest):
    """The target's server with its prefix cache on (both servers' default; ServerSpec.for_target's
    prefix_cache), vLLM with VLLM_SERVER_DEV_MODE=1 so that POST /reset_prefix_cache is served; started after every
    other server of the session has stopped. A --server-info server started with the cache off makes
    its cases skip; a --server-url server is measured as it runs."""
    yield from _serve(target, perf, recorder, request, cached=True)


def _serve(
    target: str, perf: PerfSettings, recorder: Recorder, request: pytest.FixtureRequest, cached: bool
) -> Iterator[ServerUnderTest]:
    process = None
    ready_after_s = None
    key = f"{target}-cached" if cached else target
    try:
        if info := perf.server_infos.get(target):
            base_url, server_args = str(info["base_url"]).rstrip("/"), list(info["args"])
            ready_after_s = info.get("ready_after_s")
            if cached and CACHE_OFF_FLAG in server_args:
                pytest.skip(
                    f"the {target} server of --server-info runs with {CACHE_OFF_FLAG}: the prefix-cache "
                    "cases need one with the cache on (`python -m bench serve --prefix-cache`)"
                )
        elif perf.server_url:
            base_url, server_args = perf.server_url.rstrip("/"), []
        else:
            if target == "vllm" and (reason := vllm_unavailable_reason()):
                pytest.skip(reason)
            folder = model_dir(perf)
            spec = ServerSpec.for_target(target, folder, perf.dtype, prefix_cache=cached)
            server_args = spec.args
            recorder.stop_servers()  # the GPU to this server alone (the cache-off one is done)
            process = ServerProcess(spec, perf.out / f"{key}-server.log")
            recorder.servers[key] = process
            process.start(timeout_s=300.0 if target == "vllm" else 180.0)
            base_url, ready_after_s = spec.base_url, process.ready_after_s
        api_key = os.environ.get("OPENAI_API_KEY")  # as bench's --api-key default: a server with --api-key
        endpoint = Endpoint(
            base_url=base_url, model=first_model(base_url, api_key), target=target, api_key=api_key
        )
        described = probe(endpoint)
        body = (described.get("server") or {}).get("body") or {}  # type: ignore[union-attr]
        if key in recorder.served:
            raise RuntimeError(
                f"the {key} server was started twice in one session: its cases were not grouped"
            )
        recorder.served.add(key)
        modes = modes_served(request.session.items, target, "cached_server" if cached else "server")
        for mode in modes:
            record = recorder.record(target, mode)
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
        # Each mode its cases use: the sampled path has kernels of its own to compile and warm, text
        # and chat the server's tokenizer and chat template. The prefix-cache cases' levels each start
        # from an empty cache with prompts of their own: a greedy warm-up serves them all.
        for mode in [GREEDY] if cached else modes:
            warmup = mode_workload(perf, mode, seed=1)
            if warmup is not None:  # else the mode's cases skip (NO_TOKENIZER)
                run_closed_loop(endpoint, warmup, perf.profile.warmup_concurrency, perf.profile.warmup)
        yield ServerUnderTest(target, endpoint)
    finally:
        if process is not None:
            process.stop()


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    recorder: Recorder | None = getattr(config, "_perf_recorder", None)
    if recorder is None or not recorder.records:
        return
    terminalreporter.section("perf: figures and budgets")
    for record in recorder.records.values():
        if not record.measured:
            continue
        summary = record.summary(recorder.perf.trials)
        terminalreporter.write_line(
            f"{record.title}: capacity {summary.get('capacity_req_s')} req/s (still rising: {summary.get('capacity_still_rising')}), {recorder.perf.trials} trial(s), profile {recorder.perf.profile.name}"
        )
        for key, entry in (summary.get("offline") or {}).items():
            terminalreporter.write_line(f"  offline {describe_entry(key, entry)}")
        for level in summary["closed_loop"]:
            terminalreporter.write_line(
                f"  concurrency {level['concurrency']:g}: {level['output_tok_s']:.1f} tok/s (min {level['output_tok_s_min']:.1f}, max {level['output_tok_s_max']:.1f}), TTFT p50 {level['ttft_p50_s']:.3f} s, TPOT p50 {level['tpot_p50_s']:.4f} s"
                + describe_first_token(level)
                + describe_kernel_compiles(level)
            )
        for note in record.notes:
            terminalreporter.write_line(f"  {note}")
        for check in record.checks:
            terminalreporter.write_line(f"  {check.describe()}")
        if record.checks:
            terminalreporter.write_line(f"  {tally(record.checks)}")
    terminalreporter.write_line(f"summaries and report under {recorder.perf.out}/")

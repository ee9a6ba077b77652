"""The child process of `bench offline`: one target's step-level engine, driven in process, timed.

`python -m bench.offline_worker CONFIG.json RESULT.json` is started by bench.offline, never run by
hand. It imports the target (this project's `engine`, or vLLM) lazily, behind a three-call adapter
(add, step, has_unfinished), so the bench process itself never imports either. It records each
request as a bench.metrics.RequestRow, every token timestamped at the end of the step that returned
it, and writes the rows and the step counts as JSON; bench.offline summarises them.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from bench.metrics import RequestRow
from bench.workload import Request, WorkloadSpec, make_request


class WorkerError(Exception):
    """A failure the worker explains in one line (no traceback): the target cannot be loaded."""


class Target(Protocol):
    """What the worker needs of a step-level engine. `step` returns, for each request that advanced,
    (request id, tokens new this step, finished)."""

    def add(self, request_id: str, request: Request) -> None: ...

    def step(self) -> list[tuple[str, int, bool]]: ...

    def has_unfinished(self) -> bool: ...

    def reset_step_timing(self) -> None: ...

    def step_timing(self) -> dict[str, float]: ...

    def prefix_cache_counters(self) -> tuple[int, int] | None:
        """(prompt tokens looked up, tokens found) in the prefix cache since start, as the target's
        own counters define them (both count a request's tokens when it is first scheduled, as
        vLLM's `prefix_cache_queries` / `prefix_cache_hits`); None when the target keeps none."""
        ...

    def describe(self) -> dict[str, Any]: ...


def sampling_params(factory: Any, request: Request) -> Any:
    """The request's SamplingParams from a target's own class (the engine's and vLLM's take the same
    names): the workload's sampling, ignore_eos so that every request generates its whole budget."""
    return factory(
        max_tokens=request.max_tokens, temperature=request.temperature, top_p=request.top_p, ignore_eos=True
    )


class EngineTarget:
    """This project's `engine.LLMEngine`: greedy, ignore_eos, the perf tier's options (prefix caching
    off, as vLLM's below, unless `options` turn it on)."""

    def __init__(
        self, model_dir: str, dtype: str, max_model_len: int, seed: int, options: dict[str, Any]
    ) -> None:
        import dataclasses

        from engine import EngineArgs, LLMEngine, SamplingParams, __version__

        known = {f.name for f in dataclasses.fields(EngineArgs)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise WorkerError(
                f"the engine has no option {', '.join(unknown)} (EngineArgs: {', '.join(sorted(known))})"
            )
        options = {"enable_prefix_caching": False, **options}
        self.version = __version__
        self.sampling = SamplingParams
        self.engine = LLMEngine(
            EngineArgs(model=model_dir, dtype=dtype, max_model_len=max_model_len, seed=seed, **options)
        )

    def add(self, request_id: str, request: Request) -> None:
        params = sampling_params(self.sampling, request)
        self.engine.add_request(request_id, request.prompt, params)

    def step(self) -> list[tuple[str, int, bool]]:
        return [(out.request_id, len(out.new_token_ids), out.finished) for out in self.engine.step()]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def reset_step_timing(self) -> None:
        self.engine.timer.reset()

    def step_timing(self) -> dict[str, float]:
        """The engine's mean milliseconds per step of each phase, as `step_<phase>_ms`."""
        summary = self.engine.timer.summary()
        return {
            f"step_{key}": value for key, value in summary.items() if key.endswith("_ms") and key != "step_ms"
        }

    def prefix_cache_counters(self) -> tuple[int, int] | None:
        stats = self.engine.stats()
        return stats.prefix_cache_queries, stats.prefix_cache_hits

    def describe(self) -> dict[str, Any]:
        """Name, version, every option in force, and (read at the end of the run) the prefix cache's
        tokens looked up and found since start, warm-up included, and their ratio, and the kernel
        variants compiled after start-up (engine.kernel_compiles: each a stall of the whole loop)."""
        return {
            "name": "paged-engine",
            "version": self.version,
            "config": self.engine.config_dict(),
            "prefix_cache": prefix_cache_entry(self.prefix_cache_counters()),
            "kernel_compiles": self.engine.stats().kernel_compiles,
        }


class VllmTarget:
    """vLLM's offline `LLMEngine`, made as its offline API `vllm.LLM` makes it (usage context
    LLM_CLASS): same dtype and context as the engine, prefix caching off, seed 0, everything else at
    the defaults a `vllm.LLM` user gets; token-id prompts.

    Why the usage context matters: vLLM picks its step limits from it. `vllm.LLM` on an H200 gets
    16,384 tokens a step and 1,024 sequences; `LLMEngine.from_engine_args` left at its default
    context falls back to the scheduler's own 2,048 and 128, which no vLLM user runs offline. Its
    stats stay on (a `vllm.LLM` turns them off), for the prefix cache counters; `describe` records
    the limits in force."""

    def __init__(
        self, model_dir: str, dtype: str, max_model_len: int, seed: int, options: dict[str, Any]
    ) -> None:
        try:
            import vllm
        except ImportError as exc:
            raise WorkerError(
                f"cannot import vllm in the worker ({exc}); install it, or set PERF_VLLM_ENV to a "
                "staged site's env file"
            ) from exc
        self.version = getattr(vllm, "__version__", None)
        self.sampling = vllm.SamplingParams
        self.options = {
            "model": model_dir,
            "dtype": dtype,
            "max_model_len": max_model_len,
            "enable_prefix_caching": False,
            "seed": seed,
            **options,
        }
        try:
            engine_args = vllm.EngineArgs(**self.options)
        except TypeError as exc:  # an option vLLM's EngineArgs does not have
            raise WorkerError(f"vLLM refused the options {options}: {exc}") from exc
        from vllm.usage.usage_lib import UsageContext

        self.engine = vllm.LLMEngine.from_engine_args(engine_args, usage_context=UsageContext.LLM_CLASS)
        self.seen: dict[str, int] = {}  # request id -> tokens reported so far (vLLM's are cumulative)
        self.aliases: dict[str, str] = {}  # an id vLLM assigned -> ours

    def add(self, request_id: str, request: Request) -> None:
        params = sampling_params(self.sampling, request)
        prompt = request.prompt
        inputs = {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt
        assigned = self.engine.add_request(request_id, inputs, params)
        if isinstance(assigned, str) and assigned != request_id:
            self.aliases[assigned] = request_id

    def step(self) -> list[tuple[str, int, bool]]:
        advanced = []
        for out in self.engine.step():
            request_id = self.aliases.get(out.request_id, out.request_id)
            total = len(out.outputs[0].token_ids) if out.outputs else 0
            new = total - self.seen.get(request_id, 0)
            self.seen[request_id] = total
            if out.finished:
                del self.seen[request_id]
            advanced.append((request_id, new, out.finished))
        return advanced

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def reset_step_timing(self) -> None:
        pass

    def step_timing(self) -> dict[str, float]:
        return {}  # vLLM has no per-phase timer we could read: only the worker's own step_ms

    def prefix_cache_counters(self) -> tuple[int, int] | None:
        """vLLM's `vllm:prefix_cache_queries` and `_hits` counters (the ones its server exports on
        /metrics), read from its in-process Prometheus registry; None where its stats are off."""
        try:
            metrics = self.engine.get_metrics()
        except Exception:  # noqa: BLE001 - stat logging disabled (an assert), or an older vLLM
            return None
        totals = {"vllm:prefix_cache_queries": 0, "vllm:prefix_cache_hits": 0}
        seen = False
        for metric in metrics:
            if metric.name in totals:
                totals[metric.name] += int(metric.value)
                seen = True
        return (totals["vllm:prefix_cache_queries"], totals["vllm:prefix_cache_hits"]) if seen else None

    def limits_in_force(self) -> dict[str, Any]:
        """The step limits vLLM chose (its scheduler config), which the options passed do not show."""
        scheduler = getattr(getattr(self.engine, "vllm_config", None), "scheduler_config", None)
        return {name: getattr(scheduler, name, None) for name in ("max_num_batched_tokens", "max_num_seqs")}

    def describe(self) -> dict[str, Any]:
        return {
            "name": "vllm",
            "version": self.version,
            "config": {**self.options, **self.limits_in_force()},
            "prefix_cache": prefix_cache_entry(self.prefix_cache_counters()),
        }


def prefix_cache_entry(
    counters: tuple[int, int] | None, before: tuple[int, int] = (0, 0)
) -> dict[str, Any] | None:
    """{queries, hits, hit_rate} of the counters' growth since `before`; None without counters."""
    if counters is None:
        return None
    queries, hits = counters[0] - before[0], counters[1] - before[1]
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


TARGETS: dict[str, Callable[[str, str, int, int, dict[str, Any]], Target]] = {
    "engine": EngineTarget,
    "vllm": VllmTarget,
}


@dataclasses.dataclass
class ModeResult:
    """One mode's rows and how many steps it took: `steps` counts the step() calls that returned
    tokens, `step_ms` is the wall time of all calls / `steps` (a call that returned none, as the last
    one may, costs little and is counted in the time), so both targets' figures mean the same."""

    rows: list[RequestRow]
    steps: int = 0
    step_ms: float = 0.0
    step_timing: dict[str, float] = dataclasses.field(default_factory=dict)
    prefix_cache: dict[str, Any] | None = None  # prefix_cache_entry of this mode alone

    def as_json(self, **extra: Any) -> dict[str, Any]:
        return {
            **extra,
            "rows": [dataclasses.asdict(row) for row in self.rows],
            "steps": self.steps,
            "step_ms": self.step_ms,
            "step_timing": self.step_timing,
            "prefix_cache": self.prefix_cache,
        }


class Driver:
    """Adds requests to a target and steps it until they finish, timestamping every token.

    Times are seconds on one monotonic clock from the start of the mode (`zero`). A token's time is
    the end of the step that returned it, which is when a caller of `step()` holds it: the in-process
    analogue of a streamed chunk's arrival, so TTFT, TPOT and ITL keep their bench.metrics definitions.
    """

    def __init__(self, target: Target, label: str, workload_seed: int) -> None:
        self.target = target
        self.label = label
        self.seed = workload_seed
        self.ids = 0
        self.rows: dict[str, RequestRow] = {}
        self.last_token_s: dict[str, float] = {}
        self.zero = time.perf_counter()
        self.counters = target.prefix_cache_counters()  # before any of the mode's requests is added

    def now(self) -> float:
        return time.perf_counter() - self.zero

    def add(self, request: Request, scheduled_s: float, mode: str, concurrency: int | None) -> None:
        request_id = f"{self.label}-{self.ids}"
        self.ids += 1
        row = RequestRow(
            target="",
            mode=mode,
            rate=None,
            concurrency=concurrency,
            seed=self.seed,
            index=request.index,
            warmup=False,
            prompt_len=request.prompt_len,
            max_tokens=request.max_tokens,
            scheduled_s=scheduled_s,
            sent_s=scheduled_s,
        )
        self.target.add(request_id, request)
        row.sent_s = self.now()
        row.usage_prompt_tokens = request.prompt_len if isinstance(request.prompt, list) else None
        self.rows[request_id] = row

    def run(self, on_finish: Callable[[float], None] | None = None) -> ModeResult:
        """Step until every request has finished; `on_finish(t)` is called as each one does."""
        self.target.reset_step_timing()
        steps, step_s = 0, 0.0
        while self.target.has_unfinished():
            before = time.perf_counter()
            advanced = self.target.step()
            after = time.perf_counter()
            steps += bool(advanced)
            step_s += after - before
            t = after - self.zero
            for request_id, new_tokens, finished in advanced:
                row = self.rows[request_id]
                if new_tokens > 0:
                    if row.first_token_s is None:
                        row.first_token_s = t
                    else:
                        row.itls_s.append(t - self.last_token_s[request_id])
                    self.last_token_s[request_id] = t
                    row.output_tokens += new_tokens
                    row.chunks += 1
                if finished:
                    row.done_s = t
                    if row.output_tokens < row.max_tokens:
                        row.status = "short"
                        row.error = f"got {row.output_tokens} of {row.max_tokens} tokens"
                    if on_finish is not None:
                        on_finish(t)
        return ModeResult(
            list(self.rows.values()),
            steps,
            1e3 * step_s / steps if steps else 0.0,
            self.target.step_timing(),
            None
            if self.counters is None
            else prefix_cache_entry(self.target.prefix_cache_counters(), self.counters),
        )


def all_at_once(target: Target, label: str, requests: list[Request], seed: int, mode: str) -> ModeResult:
    """Every request added at time 0, then steps until all have finished."""
    driver = Driver(target, label, seed)
    for request in requests:
        driver.add(request, 0.0, mode, None)
    return driver.run()


def closed_loop(target: Target, spec: WorkloadSpec, concurrency: int, duration_s: float) -> ModeResult:
    """`concurrency` requests in flight: a new one is added the moment one finishes, for `duration_s`
    seconds; then the requests in flight finish (the drain counts, as in the HTTP closed loop). The
    requests are the workload's from index 0, as the HTTP closed loop sends them."""
    driver = Driver(target, f"closed{concurrency}", spec.seed)
    indices = iter(range(sys.maxsize))

    def refill(t: float) -> None:
        if t < duration_s:
            driver.add(make_request(spec, next(indices)), t, "closed", concurrency)

    for _ in range(concurrency):
        driver.add(make_request(spec, next(indices)), 0.0, "closed", concurrency)
    return driver.run(refill)


def workload(spec: WorkloadSpec, count: int, first: int = 0) -> list[Request]:
    return [make_request(spec, index) for index in range(first, first + count)]


def run(config: dict[str, Any], log: Callable[[str], None]) -> dict[str, Any]:
    """Everything `config` (written by bench.offline.OfflineConfig.as_json) asks for, as JSON."""
    spec = WorkloadSpec(**{**config["workload"], "token_range": tuple(config["workload"]["token_range"])})
    load = config["load"]
    probes = load["probes"]
    started = time.perf_counter()
    target = TARGETS[config["target"]](
        config["model_dir"],
        config["dtype"],
        config["max_model_len"],
        config["seed"],
        config.get("options", {}),
    )
    result: dict[str, Any] = {"target": target.describe(), "load_s": time.perf_counter() - started}
    log(f"{config['target']} loaded in {result['load_s']:.1f} s")
    started = time.perf_counter()
    if load["warmup"]:
        # The workload's shapes under the next seed, never the measured requests (seed-mix seed 0:
        # seed 1, the perf tier's warm-up).
        warmup = dataclasses.replace(spec, seed=spec.seed + 1)
        all_at_once(target, "warmup", workload(warmup, load["warmup"]), warmup.seed, "warmup")
    result["warmup_s"] = time.perf_counter() - started
    modes = []
    if load["n_requests"]:
        done = all_at_once(target, "all", workload(spec, load["n_requests"]), spec.seed, "all")
        modes.append(done.as_json(mode="all", concurrency=None))
        log(f"all at once: {load['n_requests']} requests in {done.steps} steps of {done.step_ms:.1f} ms")
    for concurrency in load["concurrencies"]:
        done = closed_loop(target, spec, concurrency, load["duration_s"])
        modes.append(done.as_json(mode="closed", concurrency=concurrency))
        log(f"closed loop, {concurrency} in flight: {len(done.rows)} requests in {done.steps} steps")
    result["modes"] = modes
    result["probes"] = {}
    probe_workload = dataclasses.replace(spec, kind="fixed")  # its token range and seed
    if probes["single_tokens"]:
        single = dataclasses.replace(
            probe_workload, input_len=probes["single_prompt_len"], output_len=probes["single_tokens"]
        )
        done = all_at_once(target, "single", workload(single, 1), spec.seed, "single")
        result["probes"]["single"] = done.as_json()
        log(f"single sequence: {probes['single_tokens']} tokens in {done.steps} steps")
    if probes["prefill_prompts"]:
        prefill = dataclasses.replace(probe_workload, input_len=probes["prefill_prompt_len"], output_len=1)
        # Indices past the single probe's, so no prompt repeats another (prefix caching is off anyway).
        requests = workload(prefill, probes["prefill_prompts"], first=1)
        done = all_at_once(target, "prefill", requests, spec.seed, "prefill")
        result["probes"]["prefill"] = done.as_json()
        log(f"prefill: {probes['prefill_prompts']} prompts in {done.steps} steps")
    result["target"] = target.describe()  # again: now with what the run did (the prefix cache's hits)
    return result


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bench.offline_worker CONFIG.json RESULT.json", file=sys.stderr)
        return 2
    config = json.loads(Path(args[0]).read_text())

    def log(line: str) -> None:
        print(f"[bench offline worker] {line}", file=sys.stderr, flush=True)

    try:
        result = run(config, log)
    except WorkerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 3
    Path(args[1]).write_text(json.dumps(result) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

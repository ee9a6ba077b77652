"""A whole `bench run`: probe the server, run every level asked for, write the run folder.

`RunConfig` is what the CLI builds from its flags; `run_benchmark` calls bench.probe, then
bench.runner for each rate, concurrency or the sweep (bench.prefix for closed loops from an empty
prefix cache), then bench.results.write_run.
"""

from __future__ import annotations

import dataclasses
import datetime
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.client import Endpoint
from bench.metrics import RequestRow
from bench.prefix import HITS, QUERIES, cache_counters, hit_figures, run_fresh_level
from bench.probe import probe
from bench.results import write_run
from bench.runner import LevelResult, LoadConfig, SweepConfig, run_closed_loop, run_open_loop, run_sweep
from bench.server_metrics import level_figures, level_names, read_settled_totals
from bench.workload import WorkloadSpec

RUN_FORMAT = 1


@dataclass(frozen=True)
class RunConfig:
    endpoint: Endpoint
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    load: LoadConfig = field(default_factory=LoadConfig)
    rates: tuple[float, ...] = ()
    concurrencies: tuple[int, ...] = ()
    sweep: SweepConfig | None = None
    out_dir: str = "bench-out/run"
    # Each closed-loop level from an empty prefix cache with prompts of its own (bench.prefix.
    # run_fresh_level): for servers with their prefix cache on.
    fresh_prefix_cache: bool = False


def describe_config(config: RunConfig) -> dict[str, Any]:
    """The configuration as stored in run.json (the API key is never written)."""
    described = dataclasses.asdict(config)
    described["endpoint"].pop("api_key", None)
    described["load"]["slo"] = dataclasses.asdict(config.load.slo)
    return described


def run_benchmark(config: RunConfig) -> dict[str, Any]:
    """Run everything `config` asks for, write run.json and requests.csv, and return run.json's content.

    Open-loop rates run first, then the sweep, then closed-loop concurrencies. All rows share one
    clock whose zero is the start of the first level.
    """
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    probed = probe(config.endpoint)
    stream_check = probed["stream_check"]
    warnings: list[str] = []
    if isinstance(stream_check, dict) and stream_check.get("verdict") == "buffered":
        warnings.append("the stream looks buffered on the way: TTFT and ITL will be wrong")
    clock_zero = time.monotonic()
    levels: list[LevelResult] = []
    run: dict[str, Any] = {}
    for rate in config.rates:
        before = _server_totals(config.endpoint)
        levels.append(run_open_loop(config.endpoint, config.workload, rate, config.load, clock_zero))
        levels[-1].summary.update(_server_figures(before, _server_totals(config.endpoint)))
        _print_level(levels[-1], config.load.progress)
    if config.sweep is not None:
        swept = run_sweep(config.endpoint, config.workload, config.load, config.sweep, clock_zero)
        for level in swept.levels:
            _print_level(level, config.load.progress)
        levels.extend(swept.levels)
        run["capacity_req_s"] = swept.capacity_req_s
        run["capacity_still_rising"] = swept.capacity_still_rising
    for number, concurrency in enumerate(config.concurrencies):
        if config.fresh_prefix_cache:
            level = run_fresh_level(
                config.endpoint, config.workload, concurrency, config.load, number, clock_zero
            )
        else:
            before = _server_totals(config.endpoint)
            level = run_closed_loop(config.endpoint, config.workload, concurrency, config.load, clock_zero)
            level.summary.update(_server_figures(before, _server_totals(config.endpoint)))
        levels.append(level)
        _print_level(levels[-1], config.load.progress)
    rows: list[RequestRow] = [row for level in levels for row in level.rows]
    run = {
        "format": RUN_FORMAT,
        "target": config.endpoint.target,
        "model": config.endpoint.model,
        "started_at": started,
        "finished_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": describe_config(config),
        **probed,
        "client": {"python": platform.python_version(), "platform": platform.platform(), "argv": sys.argv},
        "warnings": warnings + [note for level in levels for note in level.warnings],
        **run,
        "levels": [level.summary for level in levels],
    }
    write_run(Path(config.out_dir), run, rows)
    return run


def _print_level(level: LevelResult, verbose: bool) -> None:
    if not verbose:
        return
    s = level.summary
    where = f"rate {s['rate']:g}/s" if s["mode"] == "open" else f"concurrency {s['concurrency']}"
    print(
        f"{where}: served {s['served_req_s']:.2f} req/s, {s['output_tok_s']:.1f} tok/s, "
        f"TTFT p50 {s['ttft_p50_s']:.3f} s p99 {s['ttft_p99_s']:.3f} s, TPOT p50 {s['tpot_p50_s']:.4f} s, "
        f"failures {s['failures']}",
        file=sys.stderr,
    )


def _server_totals(endpoint: Endpoint) -> dict[str, float] | None:
    """The server's /metrics totals that a level's figures come from, once settled."""
    return read_settled_totals(endpoint, (*QUERIES, *HITS, *level_names()))


def _server_figures(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, float]:
    """What the server saw of a level: its prefix cache hits, the parts of its time to first token, the
    kernel variants it compiled."""
    return {
        **hit_figures(cache_counters(before), cache_counters(after)),
        **level_figures(before, after),
    }

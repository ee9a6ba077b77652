"""`python -m bench host-cost --server-info FILE...`: the host CPU a running server spends per 1,000
output tokens under bench's closed loop, over its whole process tree, for any target.

`bench host-cost --model DIR` (bench.host_cost) takes the model out of this project's server to see
its host work alone. This mode measures a server as it runs, GPU and all, and vLLM's as well as ours,
with one tool: each server described by `python -m bench serve --info FILE` is warmed up, then one
closed loop of `--requests` requests at `--concurrency` is sent while the CPU time of the described
process and every live descendant (API processes, the engine core; vLLM's API server and EngineCore)
is read from /proc before and after. A process that busy-polls counts what it burns; one that exits
during the loop takes its CPU time with it. Several descriptions are measured one after the other
into one report, but their servers are then all up and share the GPU's memory and the host: for
figures, measure one server a command, stopping it before the next starts.

The figure, CPU-seconds per 1,000 output tokens, is what serving costs the host beside the GPU: on a
host with few cores, or at a concurrency where the API side saturates a core, it is what caps tokens/s.
"""

from __future__ import annotations

import argparse
import datetime
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.client import Endpoint
from bench.host_cost import measure_tree_loop, process_tree
from bench.launch import load_server_info
from bench.machine import describe_machine
from bench.probe import first_model
from bench.workload import PromptFormat, WorkloadSpec


@dataclass(frozen=True)
class TreeCostConfig:
    """The closed loop each server gets: `requests` requests of `input_len` prompt tokens (token ids,
    or text of that length made with the server's tokenizer) generating `output_len`, `concurrency` in
    flight, after a warm-up of `concurrency` requests, from `workers` client processes."""

    concurrency: int = 64
    requests: int = 512
    input_len: int = 128
    output_len: int = 256
    prompt_format: PromptFormat = "token-ids"
    workers: int = 1  # client processes sharing the loop


def measure_server(info: dict[str, Any], config: TreeCostConfig) -> dict[str, Any]:
    """One running server (a `bench serve` description): its tree's CPU over one closed loop."""
    pid = info.get("pid")
    if not isinstance(pid, int) or not process_tree(pid):
        raise ValueError(f"the {info['target']} server described (pid {pid}) is not running")
    base_url = str(info["base_url"]).rstrip("/")
    endpoint = Endpoint(base_url, model=first_model(base_url), target=str(info["target"]))
    tokenizer = str(info["model_dir"]) if config.prompt_format == "text" else None
    workload = WorkloadSpec(
        kind="fixed",
        input_len=config.input_len,
        output_len=config.output_len,
        prompt_format=config.prompt_format,
        tokenizer=tokenizer,
    )
    loop = measure_tree_loop(endpoint, workload, config.concurrency, config.requests, pid, config.workers)
    rows, tokens, cpu_s, wall_s = loop.rows, loop.output_tokens, loop.cpu_s, loop.wall_s
    return {
        "target": info["target"],
        "base_url": base_url,
        "pid": pid,
        "server_args": info.get("args"),
        "completed": sum(row.ok for row in rows),
        "failures": sum(not row.ok for row in rows),
        "output_tokens": tokens,
        "wall_s": wall_s,
        "output_tok_s": tokens / wall_s,
        "server_cpu_s": cpu_s,
        "server_cpu_s_per_1000_tokens": cpu_s / tokens * 1000 if tokens else None,
        "server_cores": cpu_s / wall_s,
        "processes": [asdict(process) for process in loop.processes],
        "client": loop.client,
    }


def run(args: argparse.Namespace) -> int:
    """`bench host-cost --server-info FILE...` (its flags: bench.host_cost.add_arguments)."""
    config = TreeCostConfig(
        concurrency=args.concurrency,
        requests=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        prompt_format=args.prompt_format,
        workers=args.workers,
    )
    return run_servers(args.server_info, config, Path(args.out) if args.out else None)


def run_servers(info_paths: list[str], config: TreeCostConfig, out: Path | None) -> int:
    """Measure each described server in turn, print a line each (and the engine's figure against
    vLLM's when both were measured), write the JSON report. 0 when every request succeeded, 1 when
    some failed, 2 when a description is unusable or its server is not running."""
    try:
        infos = [load_server_info(path) for path in info_paths]
        servers = [measure_server(info, config) for info in infos]
    except ValueError as exc:
        print(f"bench host-cost: {exc}")
        return 2
    for server in servers:
        per_1000 = server["server_cpu_s_per_1000_tokens"]
        shown = "no tokens, no" if per_1000 is None else f"{per_1000:.3f}"
        print(
            f"{server['target']}: {shown} CPU-s per 1,000 output tokens over {len(server['processes'])} "
            f"processes ({server['server_cores']:.2f} cores), {server['output_tok_s']:,.0f} output tok/s at "
            f"{config.concurrency} in flight; {server['completed']} requests, {server['failures']} failed"
        )
        if per_1000 is not None:
            shares = (
                f"{entry['name']} (pid {entry['pid']}) {entry['cpu_s'] / server['output_tokens'] * 1000:.3f}"
                for entry in server["processes"]
            )
            print("  by process: " + ", ".join(shares))
    by_target = {server["target"]: server for server in servers}
    if {"engine", "vllm"} <= set(by_target) and all(
        by_target[target]["server_cpu_s_per_1000_tokens"] for target in ("engine", "vllm")
    ):
        ratio = (
            by_target["engine"]["server_cpu_s_per_1000_tokens"]
            / by_target["vllm"]["server_cpu_s_per_1000_tokens"]
        )
        print(f"engine / vLLM: {ratio:.2f}x the host CPU per output token")
    if out:
        report = {
            "kind": "host-cost-servers",
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "machine": describe_machine(),
            "config": asdict(config),
            "servers": servers,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if all(server["failures"] == 0 for server in servers) else 1

"""`python -m bench host-cost --model DIR`: the host CPU that one streamed token costs in this project's
server, with the model taken out.

The server runs as `python -m server` does (the API process: its app on uvicorn, detokenization and
SSE; the engine core process: scheduling, step preparation, the step loop), except that each step's
sampled tokens are one constant token id instead of the model's: what is left is the host's work per
token. bench's client keeps `--concurrency` streams of `--output-len` tokens going from another
process, as in a closed-loop level; the figure is the CPU time (user + system, from /proc) of the
server's process tree over the tokens it streamed, with the output tokens/s it sustained and the HTTP
parser and event loop it ran on.

Why it matters: on a GPU the model's step and this host work overlap, but once the core's host work
of a step (this figure's engine share x the sequences in it) outlasts the GPU's step
(`engine.profile`), or the API process's share of a step's tokens outlasts it, the server is
host-bound. It needs no GPU, so a change to the serving path can be measured on any machine, and
CPUs compared as they are.

It also measures each half alone: the engine's steps with the same constant token (the same closed
loop, no server), by step phase; and the server over an engine that only emits the token (no
scheduling, cache or detokenization), the HTTP side's cost. The children (`--serve`, `--engine-only`)
import the engine and the server; the parent, like the rest of bench, only talks HTTP and reads their
output. `--server-info` instead samples any running server's whole process tree (vLLM's too) under a
real load.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.client import Endpoint
from bench.launch import ServerProcess, ServerSpec, free_port
from bench.machine import describe_machine
from bench.metrics import RequestRow
from bench.probe import first_model
from bench.runner import LoadConfig, run_closed_loop
from bench.trials import CLIENT_LOAD_KEYS
from bench.workload import WorkloadSpec

CONSTANT_TOKEN = 1234  # in every vocabulary this project serves, and not an end-of-sequence token
READY_LINE = "ready: serving"


@dataclass(frozen=True)
class HostCostConfig:
    model: str
    concurrency: int = 64
    requests: int = 512  # measured, after a warm-up of `concurrency` requests
    input_len: int = 128
    output_len: int = 256
    max_num_seqs: int = 256
    start_timeout_s: float = 120.0
    workers: int = 1  # client processes sharing the loop (bench.runner.LoadConfig.workers)

    @property
    def max_model_len(self) -> int:
        return self.input_len + self.output_len + 16

    def engine_flags(self) -> list[str]:
        """The engine's flags, as `python -m server` takes them: the server child starts with them and
        the engine-only child parses them, so both halves run one engine configuration."""
        blocks = self.max_num_seqs * -(-self.max_model_len // 16)
        flags = ["--device", "cpu", "--dtype", "float32", "--max-num-seqs", str(self.max_num_seqs)]
        return [
            *flags,
            "--max-model-len",
            str(self.max_model_len),
            "--block-size",
            "16",
            "--num-kv-blocks",
            str(blocks),
        ]

    def child_flags(self) -> list[str]:
        """This configuration as the flags of a `python -m bench.host_cost` child (after --model)."""
        flags = ["--concurrency", str(self.concurrency), "--requests", str(self.requests)]
        flags += ["--input-len", str(self.input_len), "--output-len", str(self.output_len)]
        return [*flags, "--max-num-seqs", str(self.max_num_seqs)]


PROC = Path("/proc")  # where process CPU times are read: Linux only


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (Linux /proc), in seconds."""
    fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _state_and_parent(pid: int | str) -> tuple[str, int] | None:
    """A process's state letter and parent pid (Linux /proc), or None once it is gone."""
    try:
        state, parent = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return state, int(parent)


def pid_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie, exited but not yet reaped, counts as gone)."""
    known = _state_and_parent(pid)
    return known is not None and known[0] != "Z"


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after `timeout_s` seconds (returns as soon as none is)."""
    deadline = time.monotonic() + timeout_s
    while any(map(pid_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [pid for pid in pids if pid_alive(pid)]


def child_pids(pid: int) -> list[int]:
    """The live child processes of `pid` (Linux /proc; an exited, unreaped child does not count)."""
    children = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        known = _state_and_parent(entry.name)
        if known is not None and known[1] == pid and known[0] != "Z":
            children.append(int(entry.name))
    return children


COMMAND_CHARS = 120  # of a process's command line kept in a reading of its tree


@dataclass(frozen=True)
class ProcessCpu:
    """One process of a server's tree: its CPU seconds (user + system) and what it runs."""

    pid: int
    name: str  # /proc/PID/comm: what ps shows (this project's core names itself engine-core)
    command: str
    cpu_s: float


def process_tree(pid: int) -> dict[int, ProcessCpu]:
    """Every live process of the tree rooted at `pid` (itself included), by pid; empty once it is gone."""
    found: dict[int, ProcessCpu] = {}
    todo = [pid]
    while todo:
        current = todo.pop()
        try:
            cpu_s = process_cpu_seconds(current)
        except OSError:
            continue
        found[current] = ProcessCpu(current, _name(current), _command(current), cpu_s)
        todo.extend(child_pids(current))
    return found


def _name(pid: int) -> str:
    try:
        return (PROC / str(pid) / "comm").read_text().strip()
    except OSError:
        return "?"


def _command(pid: int) -> str:
    """The command line, arguments joined by spaces (empty for a kernel thread)."""
    try:
        argv = (PROC / str(pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return "?"
    return " ".join(part.decode(errors="replace") for part in argv if part)[:COMMAND_CHARS]


def tree_delta(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> list[ProcessCpu]:
    """Each process's CPU seconds between two readings of one tree, largest first; a process that
    appeared in between counts from zero, one that is gone by `after` is left out."""
    spent = [
        ProcessCpu(pid, now.name, now.command, now.cpu_s - (before[pid].cpu_s if pid in before else 0.0))
        for pid, now in after.items()
    ]
    return sorted(spent, key=lambda process: process.cpu_s, reverse=True)


@dataclass(frozen=True)
class TreeLoop:
    """One measured closed loop against a server and what its process tree spent over it."""

    rows: list[RequestRow]  # the measured requests (no warm-up)
    processes: list[ProcessCpu]  # tree_delta over the loop
    wall_s: float
    client: dict[str, float]  # the client's processes and own load (bench.trials.CLIENT_LOAD_KEYS)

    @property
    def cpu_s(self) -> float:
        return sum(process.cpu_s for process in self.processes)

    @property
    def output_tokens(self) -> int:
        return sum(row.output_tokens for row in self.rows if row.ok)


def measure_tree_loop(
    endpoint: Endpoint, workload: WorkloadSpec, concurrency: int, requests: int, pid: int, workers: int = 1
) -> TreeLoop:
    """A warm-up of `concurrency` requests, then `requests` more at `concurrency` in flight, with the
    tree of `pid` read before and after the measured ones: both host-cost modes measure this way.
    `workers` client processes share the streams: from ~128 streams one client process's event loop
    lags (its warning), and a client that falls behind sends the server less than the load asked for.
    The client's processes are not the server's descendants, so its CPU is never counted."""
    warm_up = LoadConfig(n_requests=concurrency, workers=workers, progress=False)
    run_closed_loop(endpoint, workload, concurrency, warm_up)
    before, start = process_tree(pid), time.perf_counter()
    measured = LoadConfig(n_requests=requests, workers=workers, progress=False)
    level = run_closed_loop(endpoint, workload, concurrency, measured)
    after, wall_s = process_tree(pid), time.perf_counter() - start
    rows = [row for row in level.rows if not row.warmup]
    client = {key: level.summary[key] for key in ("workers", *CLIENT_LOAD_KEYS)}
    return TreeLoop(rows, tree_delta(before, after), wall_s, client)


def process_tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and every live descendant: the server's API process and its engine
    core's process together (a core that busy-polls counts what it burns)."""
    return sum(process.cpu_s for process in process_tree(pid).values())


def replace_the_model_with_a_constant_token() -> None:
    """In this process, every step's sampled tokens are CONSTANT_TOKEN, with no forward pass."""
    import torch

    from engine.runner import ModelRunner, PendingTokens

    def launch(self: ModelRunner, batch: Any) -> PendingTokens:
        # What ModelRunner.launch keeps for the next step's preparation; no forward pass, no sampling.
        self._last_sample_index = self._next_sample_index
        if not batch.num_sampled:
            self._last_tokens = None
            return PendingTokens(None, None, [])
        tokens = torch.full((batch.num_sampled,), CONSTANT_TOKEN, dtype=torch.int64)
        self._last_tokens = tokens
        return PendingTokens(tokens, None, batch.sample_order)

    ModelRunner.launch = launch  # type: ignore[method-assign]


def replace_the_engine_with_an_emitter() -> None:
    """In this process (the engine core's), LLMEngine validates a request and then only emits
    CONSTANT_TOKEN for it each step until max_tokens: no scheduling, cache, preparation or detokenization. What a server built on
    it spends is the HTTP side's cost (and the engine thread's loop), with the engine's work taken out."""
    from engine import LLMEngine, RequestOutput, SamplingParams

    running: dict[str, list[int]] = {}  # request id -> [tokens wanted, tokens sent]
    piece: list[str] = []

    def add_request(
        self: LLMEngine, request_id: str, prompt: Any, params: SamplingParams, arrival_time: Any = None
    ) -> None:
        self.validate(prompt, params)
        running[request_id] = [params.max_tokens, 0]

    def step(self: LLMEngine) -> list[RequestOutput]:
        if not piece:
            piece.append(str(self.tokenizer.decode([CONSTANT_TOKEN])))
        outputs = []
        for request_id, state in list(running.items()):
            state[1] += 1
            done = state[1] >= state[0]
            reason = "length" if done else None
            outputs.append(RequestOutput(request_id, [], [CONSTANT_TOKEN], "", piece[0], done, reason))
            if done:
                del running[request_id]
        return outputs

    def abort(self: LLMEngine, request_id: str) -> bool:
        return running.pop(request_id, None) is not None

    LLMEngine.add_request = add_request  # type: ignore[method-assign]
    LLMEngine.step = step  # type: ignore[method-assign]
    LLMEngine.abort = abort  # type: ignore[method-assign]
    LLMEngine.has_unfinished_requests = lambda self: bool(running)  # type: ignore[method-assign]


def serve(config: HostCostConfig, host: str, port: int, http_only: bool) -> None:
    """The child: the server on CPU with the model's forward pass replaced by a constant token (or,
    http_only, the whole engine by an emitter of it)."""
    from server.cli import main as server_main

    setup = replace_the_engine_with_an_emitter if http_only else replace_the_model_with_a_constant_token
    argv = ["--model", config.model, "--host", host, "--port", str(port), *config.engine_flags()]
    raise SystemExit(server_main([*argv, "--disable-uvicorn-access-log"], core_setup=setup))


def engine_only(config: HostCostConfig) -> dict[str, float]:
    """The engine's steps alone, in the child: `concurrency` sequences kept running (a new request as
    one finishes, as the closed loop does), `requests` of them measured after as many warm-up ones;
    the host's microseconds per generated token, in all and by step phase (engine.timer)."""
    from engine import LLMEngine, SamplingParams
    from server.cli import build_parser, engine_args

    replace_the_model_with_a_constant_token()
    flags = build_parser().parse_args(["--model", config.model, *config.engine_flags()])
    engine = LLMEngine(engine_args(flags))
    params = SamplingParams(max_tokens=config.output_len, temperature=0.0, ignore_eos=True)
    prompt = [1000 + i % 29000 for i in range(config.input_len)]

    def closed_loop(count: int, tag: str) -> tuple[float, int]:
        sent = finished = tokens = 0
        start = time.perf_counter()
        while finished < count:
            while sent < count and sent - finished < config.concurrency:
                engine.add_request(f"{tag}-{sent}", prompt, params)
                sent += 1
            for output in engine.step():
                tokens += len(output.new_token_ids)
                finished += output.finished
        return time.perf_counter() - start, tokens

    closed_loop(config.concurrency, "warm-up")
    engine.timer.reset()
    wall_s, tokens = closed_loop(config.requests, "measured")
    per_step = engine.timer.summary()
    steps = per_step["num_steps"]
    figures = {"engine_us_per_token": wall_s / tokens * 1e6, "engine_output_tokens": float(tokens)}
    for key, value in per_step.items():
        if key.endswith("_ms") and key != "step_ms":
            figures[f"engine_{key.removesuffix('_ms')}_us_per_token"] = value * 1e3 * steps / tokens
    return figures


def measure(config: HostCostConfig, log_path: Path, http_only: bool = False) -> dict[str, Any]:
    """Start the server child, warm it up, measure one closed loop; the child is stopped whatever
    happens."""
    args = ["--serve", *(["--http-only"] if http_only else []), *config.child_flags()]
    spec = ServerSpec("engine", config.model, free_port(), args, module="bench.host_cost")
    with ServerProcess(spec, log_path) as server:
        server.start(timeout_s=config.start_timeout_s)
        assert server.process is not None
        endpoint = Endpoint(spec.base_url, model=first_model(spec.base_url))
        workload = WorkloadSpec(kind="fixed", input_len=config.input_len, output_len=config.output_len)
        pid = server.process.pid
        loop = measure_tree_loop(endpoint, workload, config.concurrency, config.requests, pid, config.workers)
    rows, cpu_s, wall_s, tokens = loop.rows, loop.cpu_s, loop.wall_s, loop.output_tokens
    chunks = sum(row.chunks for row in rows if row.ok)
    stack = _stack(log_path.read_text())
    return {
        "kind": "host-cost",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "config": asdict(config),
        "machine": describe_machine(),
        "http": stack[0],
        "event_loop": stack[1],
        "completed": sum(row.ok for row in rows),
        "failures": sum(not row.ok for row in rows),
        "output_tokens": tokens,
        "chunks": chunks,
        "tokens_per_chunk": tokens / max(chunks, 1),
        "wall_s": wall_s,
        "server_cpu_s": cpu_s,
        "server_cpu_us_per_token": cpu_s / tokens * 1e6 if tokens else None,
        "server_cpu_util": cpu_s / wall_s,
        "output_tok_s": tokens / wall_s,
        "client": loop.client,
    }


def _stack(log: str) -> tuple[str, str]:
    """(HTTP parser, event loop) from the server's ready line."""
    for line in log.splitlines():
        if READY_LINE in line and "; HTTP " in line:
            http, loop = line.split("; HTTP ", 1)[1].rstrip(")").split(", event loop ")
            return http, loop
    return "unknown", "unknown"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = HostCostConfig(model="")
    parser.add_argument("--model", help="model folder (its tokenizer and config are used)")
    parser.add_argument(
        "--server-info",
        action="append",
        default=[],
        help="measure this running server instead (a `bench serve --info` file; repeat for several, "
        "measured in turn): its whole process tree's CPU per 1,000 output tokens (bench/server_cpu.py)",
    )
    parser.add_argument(
        "--prompt-format",
        choices=["token-ids", "text"],
        default="token-ids",
        help="with --server-info: send token ids, or text of --input-len tokens made with the server's "
        "tokenizer (its tokenizing then counts)",
    )
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="streams in flight")
    parser.add_argument("--requests", type=int, default=defaults.requests, help="requests measured")
    parser.add_argument("--input-len", type=int, default=defaults.input_len, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=defaults.output_len, help="tokens streamed each")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs)
    parser.add_argument(
        "--workers",
        type=int,
        default=defaults.workers,
        help="client processes sharing the streams (from ~128 streams one process's event loop lags)",
    )
    parser.add_argument(
        "--out", help="write the figures here (JSON); with --model, the server's log goes beside it"
    )


def measure_engine_only(config: HostCostConfig) -> dict[str, float]:
    """engine_only in a child process (bench itself does not import the engine)."""
    command = [sys.executable, "-m", "bench.host_cost", "--engine-only", "--model", config.model]
    command += config.child_flags()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"the engine-only run failed ({done.returncode}): {done.stderr[-2000:]}")
    figures: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return figures


def _config(args: argparse.Namespace) -> HostCostConfig:
    return HostCostConfig(
        model=args.model,
        concurrency=args.concurrency,
        requests=args.requests,
        input_len=args.input_len,
        output_len=args.output_len,
        max_num_seqs=args.max_num_seqs,
        workers=args.workers,
    )


def run(args: argparse.Namespace) -> int:
    if not (PROC / "self" / "stat").is_file():
        print(f"bench host-cost: reads process CPU times from {PROC}, which this system lacks (Linux only)")
        return 2
    config = _config(args)
    out = Path(args.out) if args.out else None
    log_path = out.with_suffix(".log") if out else Path("bench-out") / "host-cost-server.log"
    figures = measure(config, log_path)
    http = measure(config, log_path.with_name(f"{log_path.stem}-http-only.log"), http_only=True)
    figures["http_only_us_per_token"] = http["server_cpu_us_per_token"]
    figures["http_only_output_tok_s"] = http["output_tok_s"]
    figures["http_only_tokens_per_chunk"] = http["tokens_per_chunk"]
    figures.update(measure_engine_only(config))
    phases = ", ".join(
        f"{phase} {figures[f'engine_{phase}_us_per_token']:.2f}"
        for phase in ("schedule", "prepare", "execute", "update", "outputs")
    )
    print(
        f"host cost: {figures['server_cpu_us_per_token']:.1f} us of server CPU a streamed token, "
        f"{figures['output_tok_s']:,.0f} output tok/s at {config.concurrency} streams "
        f"(server CPU {figures['server_cpu_util']:.0%}; HTTP {figures['http']}, event loop "
        f"{figures['event_loop']}; {figures['tokens_per_chunk']:.2f} tokens a chunk; "
        f"{figures['completed']} requests, {figures['failures']} failed)\n"
        f"engine alone: {figures['engine_us_per_token']:.2f} us a token ({phases}); "
        f"HTTP side alone (an engine that only emits the token): {figures['http_only_us_per_token']:.1f} us "
        f"a token, {figures['http_only_output_tok_s']:,.0f} tok/s"
    )
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(figures, indent=2) + "\n")
        print(f"wrote {out}")
    return 0 if figures["failures"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.host_cost", description=__doc__)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--host", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--http-only", action="store_true", help=argparse.SUPPRESS)
    add_arguments(parser)
    args = parser.parse_args(argv)
    if args.serve:
        serve(_config(args), args.host, args.port, args.http_only)
    if args.engine_only:
        print(json.dumps(engine_only(_config(args))))
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())

"""Command line: `python -m bench run|offline|report|compare|merge|budgets|serve|stop|ab|host-cost|fidelity-summary`.

`run` turns flags into a bench.suite.RunConfig and calls run_benchmark; `offline` drives a target's
step-level engine in a child process (bench.offline.run_offline); `report` calls
bench.report.write_report (with `--png`, write_plots); `compare` calls bench.compare.compare_results and exits 1 on a regression;
`merge` folds perf summaries run separately, pooling their trials (bench.trials.merge_summaries);
`budgets` proposes the perf tier's budgets from two summaries (bench.budget_proposal); `serve`
starts a target's server as the perf tier would and leaves it running (bench.launch); `ab` measures
two commits on this machine, interleaved, and compares them (bench.ab); `fidelity-summary` folds
alternating runs of bench and `vllm bench serve` into one JSON (bench.fidelity, scripts/fidelity.sh).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlparse

import httpx

from bench.ab import AbConfig, AbError, run_ab
from bench.budget_proposal import DEFAULT_MARGIN, propose_budgets
from bench.budget_proposal import table as proposal_table
from bench.budgets import load_budgets
from bench.client import Endpoint
from bench.compare import DEFAULT_MAX_DROP, EXIT_BAD_INPUT, compare_results, parse_max_drop
from bench.fidelity import DEFAULT_TOLERANCE_PCT, Run, describe, summarize_runs
from bench.host_cost import add_arguments as add_host_cost_arguments
from bench.host_cost import run as run_host_cost
from bench.launch import (
    MAX_MODEL_LEN,
    ServerProcess,
    ServerSpec,
    load_server_info,
    stop_described_server,
    stop_servers_on_sigterm,
)
from bench.metrics import parse_slo
from bench.offline import (
    OfflineConfig,
    OfflineError,
    OfflineLoad,
    Probes,
    describe_entry,
    failed_entries,
    run_json,
    run_offline,
)
from bench.probe import ServerQueryError, first_model
from bench.profiles import PROFILES
from bench.report import write_plots, write_report
from bench.results import json_safe, write_run
from bench.runner import LoadConfig, SweepConfig
from bench.server_cpu import run as run_server_cpu
from bench.suite import RunConfig, run_benchmark
from bench.trials import merge_summaries
from bench.workload import WorkloadSpec

T = TypeVar("T")
DEFAULT_CONCURRENCY = "1,8,32,128"


def _list_of(cast: Callable[[str], T]) -> Callable[[str], tuple[T, ...]]:
    def parse(text: str) -> tuple[T, ...]:
        try:
            return tuple(cast(part) for part in text.split(",") if part.strip())
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from exc

    return parse


def _add_sampling_arguments(group: argparse._ArgumentGroup) -> None:
    """How every request samples; the same flags for `run` (over HTTP) and `offline`."""
    group.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; 1.0 is the OpenAI API's default"
    )
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus; 1.0 (default) keeps every token")


WORKLOADS = ["seed-mix", "fixed", "jsonl", "shared-prefix", "multi-turn"]


def _add_prefix_workload_arguments(group: argparse._ArgumentGroup) -> None:
    """The shared-prefix and multi-turn workloads' shape; the same flags for `run` and `offline`."""
    defaults = WorkloadSpec()
    group.add_argument(
        "--num-prefixes", type=int, default=defaults.num_prefixes, help="shared-prefix: prefixes"
    )
    group.add_argument(
        "--prefix-len",
        type=int,
        default=defaults.prefix_len,
        help="shared-prefix: tokens of each prefix; multi-turn: of each conversation's first message",
    )
    group.add_argument(
        "--suffix-len",
        type=int,
        default=defaults.suffix_len,
        help="shared-prefix: tokens after the prefix; multi-turn: of each later user message",
    )
    group.add_argument("--turns", type=int, default=defaults.turns, help="multi-turn: turns")
    group.add_argument(
        "--conversations",
        type=int,
        default=defaults.conversations,
        help="multi-turn: conversations interleaved (at least the requests in flight)",
    )


def _token_range(text: str) -> tuple[int, int]:
    low, _, high = text.partition(",")
    try:
        return int(low), int(high)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH, got {text!r}") from exc


def _target_option(text: str) -> tuple[str, Any]:
    """NAME=VALUE, the value read as JSON where it parses (16384, 0.9, true) and as a string otherwise."""
    name, sep, value = text.partition("=")
    if not sep or not name.isidentifier():
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {text!r}")
    try:
        return name, json.loads(value)
    except json.JSONDecodeError:
        return name, value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bench", description="Benchmark an OpenAI-compatible server."
    )
    commands = parser.add_subparsers(dest="command", required=True)

    run = commands.add_parser("run", help="replay a workload against a server and write a run folder")
    target = run.add_argument_group("target")
    target.add_argument("--base-url", required=True, help="API root, e.g. http://127.0.0.1:8000/v1")
    target.add_argument("--model", help="model name to request (default: the first id of /v1/models)")
    target.add_argument(
        "--target", help="label for this server in outputs (default: /version's name, else host:port)"
    )
    target.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    target.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")

    workload = run.add_argument_group("workload")
    workload.add_argument(
        "--workload",
        choices=["seed-mix", "fixed", "jsonl", "shared-prefix", "multi-turn"],
        default="seed-mix",
    )
    workload.add_argument("--input-len", type=int, default=128, help="fixed: prompt tokens")
    workload.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="fixed, shared-prefix: tokens to generate; multi-turn: each recorded reply's length and budget",
    )
    _add_prefix_workload_arguments(workload)
    workload.add_argument("--dataset", help="jsonl: file of {prompt, max_tokens} or ShareGPT conversations")
    workload.add_argument(
        "--token-range", type=_token_range, default=(1000, 30000), help="prompt token ids in [LOW,HIGH)"
    )
    workload.add_argument("--seed", type=int, default=0)
    workload.add_argument(
        "--prompt-format",
        choices=["token-ids", "text"],
        default="token-ids",
        help="seed-mix, fixed: send each prompt as its token ids (default) or as text of the same token "
        "length, made with the model's tokenizer (--tokenizer)",
    )
    workload.add_argument(
        "--api",
        choices=["completions", "chat"],
        default="completions",
        help="the OpenAI API to send to: /v1/completions (default) or /v1/chat/completions, each prompt "
        "as one user message of text (sized so the templated prompt has the workload's length)",
    )
    workload.add_argument(
        "--tokenizer",
        help="the model folder whose tokenizer makes text prompts (default: --model, or the served "
        "model's name, when that is a folder)",
    )
    _add_sampling_arguments(workload)

    load = run.add_argument_group("load")
    load.add_argument(
        "--rates", type=_list_of(float), default=(), help="open-loop rates in req/s, e.g. 2,4,8"
    )
    load.add_argument("--arrival", choices=["constant", "poisson"], default="poisson")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1 = Poisson)")
    load.add_argument(
        "--concurrency",
        type=_list_of(int),
        default=None,
        help=f"closed-loop levels, e.g. 1,8,32 (default {DEFAULT_CONCURRENCY} when no --rates/--sweep)",
    )
    load.add_argument(
        "--sweep", action="store_true", help="raise the open-loop rate until the server saturates"
    )
    load.add_argument("--sweep-start", type=float, default=1.0, help="first sweep rate in req/s")
    load.add_argument("--sweep-max-levels", type=int, default=12)
    load.add_argument(
        "--sweep-latency-multiple",
        type=float,
        default=SweepConfig.latency_multiple,
        help="stretch each sweep level to this many times the p90 latency where the server kept up",
    )
    load.add_argument(
        "--sweep-max-level-s", type=float, default=SweepConfig.max_level_s, help="longest sweep level"
    )
    load.add_argument("--n-requests", type=int, default=400, help="measured requests per level")
    load.add_argument("--duration", type=float, help="seconds of arrivals per level, instead of --n-requests")
    load.add_argument(
        "--warmup", type=int, default=0, help="extra requests per level, sent first, left out of figures"
    )
    load.add_argument(
        "--slo", type=parse_slo, default=parse_slo("ttft_s=0.5,tpot_s=0.05"), help="goodput SLO"
    )
    load.add_argument("--workers", type=int, default=1, help="client processes sharing the load")
    load.add_argument(
        "--fresh-prefix-cache",
        action="store_true",
        help="before each closed-loop level, POST /reset_prefix_cache and move the seed, so no level "
        "finds an earlier level's prompts cached (for a server with its prefix cache on)",
    )
    load.add_argument("--quiet", action="store_true", help="no progress bars or per-level lines")
    run.add_argument("--out", help="run folder (default bench-out/TARGET-TIME)")

    report = commands.add_parser("report", help="render run folders side by side as one HTML page")
    report.add_argument("results", nargs="+", help="run folders, run.json or summary JSON files")
    report.add_argument("--out", default="report.html")
    report.add_argument(
        "--png",
        metavar="PREFIX",
        help="instead of the page, the plots as PREFIX-open-loop.png and PREFIX-closed-loop.png "
        "(results of one workload; e.g. the README's from the stored references)",
    )

    compare = commands.add_parser(
        "compare", help="compare two results; exit 1 on a regression, 4 unreliable, 3 nothing compared"
    )
    compare.add_argument("base")
    compare.add_argument("new")
    default_drop = ",".join(f"{k}={v:g}%" for k, v in DEFAULT_MAX_DROP.items())
    shown_drop = default_drop.replace("%", "%%")  # argparse formats help strings with %
    compare.add_argument(
        "--max-drop",
        default=default_drop,
        help=f"allowed worsening per metric (default {shown_drop}); a row regresses when its "
        "worsening is past its limit and past the base's own trial spread (the new run's spread never "
        "excuses it); exit 1 on a regression, 4 when a row is unreliable (rerun), 3 when nothing with a "
        "limit was compared, 2 for bad input",
    )
    compare.add_argument(
        "--format",
        choices=["text", "markdown"],
        default="text",
        help="text: an aligned table; markdown: a GitHub-flavoured table (e.g. for $GITHUB_STEP_SUMMARY)",
    )
    ab = commands.add_parser(
        "ab",
        help="measure two commits on this machine, trials interleaved, and compare them (the regression gate)",
        description="Checks out BASE_REF and NEW_REF in git worktrees of their own; for each trial, starts "
        "that side's `python -m server` from its worktree, warms it up, measures the profile's sweep and "
        "closed loops with this checkout's bench, and stops it; trials come in pairs, base new, new base, "
        "base new...; while the verdict is unreliable, pairs are added up to --max-trials. "
        "Then `bench compare`'s rule on the pair: exit 1 on a regression, 4 unreliable (rerun), 3 nothing "
        "compared, 2 bad input or a server that did not start.",
    )
    ab.add_argument("base_ref")
    ab.add_argument("new_ref")
    ab.add_argument("--model", required=True, help="model folder (both sides serve it)")
    ab.add_argument("--dtype", default="bfloat16", help="float32 for the engine on CPU")
    ab.add_argument(
        "--profile", choices=sorted(PROFILES), default="short", help="load per trial (default short)"
    )
    ab.add_argument("--trials", type=int, default=3, help="trials per side (default 3)")
    ab.add_argument(
        "--max-trials",
        type=int,
        default=None,
        help="while the verdict is unreliable, add a trial a side up to this many (default: --trials)",
    )
    ab.add_argument("--repo", default=".", help="the git repository holding both refs")
    ab.add_argument("--work", default="perf-out/ab", help="worktrees, server logs and each side's summary")
    ab.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for each server's /health")
    ab.add_argument("--max-drop", default=default_drop, help=f"as for compare (default {shown_drop})")
    ab.add_argument("--format", choices=["text", "markdown"], default="text")

    merge = commands.add_parser(
        "merge", help="fold perf summaries of one target into one, every trial of each"
    )
    merge.add_argument("summaries", nargs="+", help="summary JSON files, of one or more trials each")
    merge.add_argument(
        "--sweep-from",
        nargs="+",
        default=None,
        help="take the open-loop sweep from these summaries (sweeps re-run on their own, or an earlier lease's); "
        "the closed loops then come from the positional ones only",
    )
    merge.add_argument("--out", required=True)

    budgets = commands.add_parser(
        "budgets",
        help="propose the perf tier's budgets from an engine and a vLLM summary of one mode "
        "(bench.budget_proposal): each figure's ratio, its least favourable pairing, the budget in force",
    )
    budgets.add_argument("engine", help="the engine's summary JSON (a stored reference, or one lease's)")
    budgets.add_argument("vllm", help="vLLM's summary JSON of the same mode")
    budgets.add_argument("--budgets", default="tests/perf/budgets.toml", help="the budget file in force")
    budgets.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help="how far past the least favourable pairing a budget sits (default %(default)s: the same "
        "vLLM moved up to 28%% between lent hosts)",
    )

    serve = commands.add_parser(
        "serve",
        help="start a target's server as the perf tier defines it, wait for /health, leave it running",
        description="Starts the server in its own process session, so it outlives this command, and "
        "writes a description (URL, flags, pid, start-up time) for `pytest -m perf --server-info`. "
        "Stop it with `python -m bench stop --info FILE`. vLLM is started through $PERF_VLLM_ENV when "
        "that is set.",
    )
    serve.add_argument("--target", choices=["engine", "vllm"], required=True)
    serve.add_argument("--model", required=True, help="model folder")
    serve.add_argument("--port", type=int, default=None, help="default: a free port")
    serve.add_argument("--dtype", default="bfloat16", help="float32 for the engine on CPU")
    serve.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    serve.add_argument("--seed", type=int, default=0)
    serve.add_argument(
        "--prefix-cache",
        action="store_true",
        help="leave the prefix cache on (each target's default; the perf tier's prefix-cache cases), and "
        "start vLLM with VLLM_SERVER_DEV_MODE=1 so that it serves POST /reset_prefix_cache",
    )
    serve.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag for the target's server, after its usual ones (repeatable; give it with "
        "'=' when it starts with '-': --server-arg=--api-server-count=2)",
    )
    serve.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for /health")
    serve.add_argument("--log", help="server log (default perf-out/TARGET-server.log)")
    serve.add_argument("--info", help="description JSON to write (default perf-out/TARGET-server.json)")

    stop = commands.add_parser(
        "stop",
        help="stop a server `bench serve` left running: SIGTERM to its process group, SIGKILL after --grace",
    )
    stop.add_argument("--info", required=True, help="the description `bench serve` wrote")
    stop.add_argument("--grace", type=float, default=60.0, help="seconds to drain before SIGKILL")

    offline = commands.add_parser(
        "offline",
        help="drive a target's step-level engine in process (no HTTP): all at once, closed loops, probes",
        description="Runs the target in a child process (`python -m bench.offline_worker`; bench never "
        "imports it), with the workload's sampling (greedy unless --temperature says otherwise) and ignore_eos, and writes run.json (its `offline` section) and "
        "requests.csv. vLLM is imported through $PERF_VLLM_ENV when that is set.",
    )
    offline.add_argument("--target", choices=["engine", "vllm"], required=True)
    offline.add_argument("--model", required=True, help="model folder")
    offline.add_argument("--dtype", default="bfloat16", help="float32 for the engine on CPU")
    offline.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    offline.add_argument(
        "--option",
        action="append",
        type=_target_option,
        default=[],
        metavar="NAME=VALUE",
        help="one more of the target's engine options (its EngineArgs field; repeatable), e.g. "
        "max_num_batched_tokens=16384 or max_num_seqs=512; recorded in run.json with the options in force",
    )
    offline_workload = offline.add_argument_group("workload")
    offline_workload.add_argument("--workload", choices=WORKLOADS, default="seed-mix")
    offline_workload.add_argument("--input-len", type=int, default=128, help="fixed: prompt tokens")
    offline_workload.add_argument(
        "--output-len",
        type=int,
        default=128,
        help="fixed, shared-prefix: tokens to generate; multi-turn: each recorded reply's length and budget",
    )
    _add_prefix_workload_arguments(offline_workload)
    offline_workload.add_argument(
        "--dataset", help="jsonl: file of {prompt, max_tokens} or ShareGPT conversations"
    )
    offline_workload.add_argument(
        "--token-range", type=_token_range, default=(1000, 30000), help="prompt token ids in [LOW,HIGH)"
    )
    offline_workload.add_argument("--seed", type=int, default=0, help="the workload's seed")
    _add_sampling_arguments(offline_workload)
    offline_load = offline.add_argument_group("load")
    defaults = OfflineLoad()
    offline_load.add_argument(
        "--n-requests",
        type=int,
        default=defaults.n_requests,
        help=f"requests added all at once (default {defaults.n_requests}; 0 skips this mode)",
    )
    offline_load.add_argument(
        "--concurrency", type=_list_of(int), default=(), help="in-process closed loops, e.g. 1,32,128"
    )
    offline_load.add_argument(
        "--duration",
        type=float,
        default=defaults.duration_s,
        help=f"closed loops: seconds of new requests (default {defaults.duration_s:g})",
    )
    offline_load.add_argument(
        "--warmup", type=int, default=defaults.warmup, help="warm-up requests first, left out of figures"
    )
    probes = offline.add_argument_group("probes (0 skips one)")
    probe_defaults = defaults.probes
    probes.add_argument("--single-prompt-len", type=int, default=probe_defaults.single_prompt_len)
    probes.add_argument(
        "--single-tokens",
        type=int,
        default=probe_defaults.single_tokens,
        help=f"one sequence alone: tokens it generates (default {probe_defaults.single_tokens})",
    )
    probes.add_argument(
        "--prefill-prompts",
        type=int,
        default=probe_defaults.prefill_prompts,
        help=f"prefill: prompts added at once, max_tokens 1 (default {probe_defaults.prefill_prompts})",
    )
    probes.add_argument("--prefill-prompt-len", type=int, default=probe_defaults.prefill_prompt_len)
    offline.add_argument(
        "--timeout", type=float, default=None, help="stop the worker after this many seconds"
    )
    offline.add_argument("--out", help="run folder (default bench-out/offline-TARGET-TIME)")

    host_cost = commands.add_parser(
        "host-cost",
        help="a server's host CPU per output token: this project's with the model replaced by a constant "
        "token (--model, no GPU), or any running server's whole process tree (--server-info)",
        description="With --model: starts this project's server on CPU with each step's tokens a constant "
        "instead of the model's, keeps --concurrency streams going with bench's client, and reports the "
        "server's CPU time per streamed token and the output tokens/s it sustained (bench/host_cost.py). "
        "With --server-info FILE (from `bench serve --info`, either target): sends one closed loop to that "
        "running server and reports the CPU-seconds its whole process tree spent per 1,000 output tokens, "
        "process by process (bench/server_cpu.py).",
    )
    add_host_cost_arguments(host_cost)

    fidelity = commands.add_parser(
        "fidelity-summary",
        help="fold alternating runs of bench and `vllm bench serve` into one JSON; exit 1 when they differ",
        description="Reads each run (a `bench run` folder, or the JSON of `vllm bench serve --save-result`), "
        "in the order they ran, and writes per-run figures, each client's medians and bench's gap to vLLM's "
        "client in percent. Exit 0 when the medians of output tokens/s are within the tolerance, 1 when "
        "not, 3 when one client has no run (nothing compared), 2 for bad input.",
    )
    fidelity.add_argument("runs", nargs="+", help="bench=DIR or vllm=FILE, in the order they ran")
    fidelity.add_argument("--out", required=True, help="summary JSON to write")
    fidelity.add_argument("--label", help="which server was measured (recorded as is)")
    fidelity.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE_PCT,
        help=f"largest gap of output tokens/s medians, in percent (default {DEFAULT_TOLERANCE_PCT:g})",
    )
    fidelity.add_argument("--bench-command", help="the bench command line, recorded as is")
    fidelity.add_argument("--vllm-command", help="the vllm bench serve command line, recorded as is")
    return parser


def command_fidelity(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    commands = {"bench": args.bench_command, "vllm": args.vllm_command}
    try:
        summary = summarize_runs(
            [Run.parse(text) for text in args.runs],
            args.tolerance,
            {client: line for client, line in commands.items() if line},
            args.label,
        )
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(summary), indent=2) + "\n")
    print(describe(summary))
    print(f"wrote {out}")
    return {True: 0, False: 1, None: 3}[summary["agree"]]


def command_offline(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        config = OfflineConfig(
            target=args.target,
            model_dir=str(Path(args.model).resolve()),
            dtype=args.dtype,
            workload=WorkloadSpec(
                args.workload,
                args.seed,
                args.token_range,
                args.input_len,
                args.output_len,
                str(Path(args.dataset).resolve()) if args.dataset else None,  # the worker runs elsewhere
                args.temperature,
                args.top_p,
                num_prefixes=args.num_prefixes,
                prefix_len=args.prefix_len,
                suffix_len=args.suffix_len,
                turns=args.turns,
                conversations=args.conversations,
            ),
            load=OfflineLoad(
                n_requests=args.n_requests,
                concurrencies=args.concurrency,
                duration_s=args.duration,
                warmup=args.warmup,
                probes=Probes(
                    args.single_prompt_len, args.single_tokens, args.prefill_prompts, args.prefill_prompt_len
                ),
            ),
            max_model_len=args.max_model_len,
            options=dict(args.option),
        )
    except ValueError as exc:
        parser.error(str(exc))
    if not Path(config.model_dir).is_dir():
        parser.error(f"--model {args.model}: not a folder")
    started = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    try:
        run = run_offline(config, timeout_s=args.timeout)
    except OfflineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finished = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    out = Path(args.out or os.path.join("bench-out", f"offline-{args.target}-{stamp}"))
    write_run(out, run_json(config, run, started, finished), run.rows)
    for key, entry in run.section.items():
        print(describe_entry(key, entry))
    print(f"wrote {out}/run.json and requests.csv")
    failed = failed_entries(run.section)
    if failed:
        print(f"error: requests failed in {', '.join(failed)} (see requests.csv)", file=sys.stderr)
        return 1
    return 0


def command_serve(args: argparse.Namespace) -> int:
    spec = ServerSpec.for_target(
        args.target,
        str(Path(args.model).resolve()),
        args.dtype,
        args.port,
        args.max_model_len,
        args.seed,
        prefix_cache=args.prefix_cache,
    )
    spec.args = [*spec.args, *args.server_arg]
    process = ServerProcess(spec, args.log or f"perf-out/{args.target}-server.log")
    try:
        process.start(timeout_s=args.timeout)  # stops the server itself if it never becomes healthy
    except (RuntimeError, TimeoutError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    info = process.describe()
    info_path = Path(args.info or f"perf-out/{args.target}-server.json")
    info_path.parent.mkdir(parents=True, exist_ok=True)
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    print(
        f"{args.target} ready at {spec.base_url} after {process.ready_after_s:.1f} s; pid {info['pid']}; "
        f"described in {info_path}; stop with: python -m bench stop --info {info_path}"
    )
    return 0


def command_stop(args: argparse.Namespace) -> int:
    try:
        was_running = stop_described_server(load_server_info(args.info), args.grace)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"stopped the server of {args.info}"
        if was_running
        else f"the server of {args.info} had already stopped"
    )
    return 0


def _read_json(paths: Sequence[str]) -> list[dict]:
    return [json.loads(Path(path).read_text()) for path in paths]


def command_merge(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        merged = merge_summaries(
            _read_json(args.summaries), _read_json(args.sweep_from) if args.sweep_from else None
        )
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(json_safe(merged), indent=2) + "\n")
    print(f"wrote {out}: {merged['trials']} trials, capacity {merged['capacity_req_s']} req/s")
    return 0


def command_budgets(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        engine, vllm = _read_json([args.engine, args.vllm])
        proposals = propose_budgets(engine, vllm, load_budgets(args.budgets), args.margin)
    except (OSError, ValueError) as exc:
        parser.error(str(exc))
    if not proposals:
        parser.error("the two summaries share no budgeted figure at any level")
    print(proposal_table(proposals, args.margin))
    return 0


def _default_target(base_url: str, root_url: str) -> str:
    try:
        body = httpx.get(f"{root_url}/version", timeout=10).json()
        if isinstance(body, dict) and body.get("name"):
            return str(body["name"])
    except (httpx.HTTPError, ValueError):
        pass
    return urlparse(base_url).netloc


def command_run(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    base_url = args.base_url.rstrip("/")
    model = args.model or first_model(base_url, args.api_key)
    root_url = Endpoint(base_url, model).root_url
    target = args.target or _default_target(base_url, root_url)
    endpoint = Endpoint(base_url, model, target, args.api_key, args.timeout)
    concurrency = args.concurrency
    if concurrency is None:
        concurrency = () if args.rates or args.sweep else _list_of(int)(DEFAULT_CONCURRENCY)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    tokenizer = args.tokenizer or (model if Path(model).is_dir() else None)
    try:
        spec = WorkloadSpec(
            args.workload,
            args.seed,
            args.token_range,
            args.input_len,
            args.output_len,
            args.dataset,
            args.temperature,
            args.top_p,
            prompt_format=args.prompt_format,
            api=args.api,
            tokenizer=str(Path(tokenizer).resolve()) if tokenizer else None,
            num_prefixes=args.num_prefixes,
            prefix_len=args.prefix_len,
            suffix_len=args.suffix_len,
            turns=args.turns,
            conversations=args.conversations,
        )
        load = LoadConfig(
            n_requests=args.n_requests,
            duration_s=args.duration,
            warmup=args.warmup,
            arrival=args.arrival,
            burstiness=args.burstiness,
            workers=args.workers,
            slo=args.slo,
            progress=not args.quiet,
        )
    except ValueError as exc:
        parser.error(str(exc))
    config = RunConfig(
        endpoint=endpoint,
        workload=spec,
        load=load,
        rates=args.rates,
        concurrencies=concurrency,
        sweep=SweepConfig(
            args.sweep_start,
            args.sweep_max_levels,
            latency_multiple=args.sweep_latency_multiple,
            max_level_s=args.sweep_max_level_s,
        )
        if args.sweep
        else None,
        out_dir=args.out or os.path.join("bench-out", f"{endpoint.target.replace(':', '_')}-{stamp}"),
        fresh_prefix_cache=args.fresh_prefix_cache,
    )
    run = run_benchmark(config)
    print(f"wrote {config.out_dir}/run.json and requests.csv ({len(run['levels'])} levels)")
    return 0


def command_ab(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        max_drop = parse_max_drop(args.max_drop)
    except ValueError as exc:
        parser.error(str(exc))
    if not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: not a folder")
    if args.trials < 1:
        parser.error("--trials must be at least 1")
    if args.max_trials is not None and args.max_trials < args.trials:
        parser.error(f"--max-trials {args.max_trials} is fewer than --trials {args.trials}")
    config = AbConfig(
        args.base_ref,
        args.new_ref,
        str(Path(args.model).resolve()),
        PROFILES[args.profile],
        trials=args.trials,
        max_trials=args.max_trials,
        dtype=args.dtype,
        repo=args.repo,
        work_dir=args.work,
        start_timeout_s=args.timeout,
        max_drop=max_drop,
    )
    try:
        result = run_ab(config)
    except AbError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    comparison = result.comparison
    print(comparison.markdown() if args.format == "markdown" else comparison.table())
    for mode, paths in result.paths.items():
        print(f"{mode} summaries: {paths['base']} and {paths['new']}", file=sys.stderr)
    return comparison.exit_status()


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return dispatch(args, parser)
    except ServerQueryError as exc:  # a server that is down or not OpenAI-shaped: one line, not a traceback
        print(f"bench {args.command}: {exc}", file=sys.stderr)
        return 2


def dispatch(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the parsed command; its exit status."""
    if args.command == "ab":
        return command_ab(args, parser)
    if args.command == "run":
        return command_run(args, parser)
    if args.command == "merge":
        return command_merge(args, parser)
    if args.command == "budgets":
        return command_budgets(args, parser)
    if args.command == "serve":
        return command_serve(args)
    if args.command == "stop":
        return command_stop(args)
    if args.command == "offline":
        return command_offline(args, parser)
    if args.command == "fidelity-summary":
        return command_fidelity(args, parser)
    if args.command == "host-cost":
        if args.server_info:
            return run_server_cpu(args)
        if not args.model:
            parser.error("host-cost needs --model (this project's server, model taken out) or --server-info")
        return run_host_cost(args)
    if args.command == "report":
        if args.png:
            try:
                drawn = write_plots(args.results, args.png)
            except (OSError, ValueError) as exc:
                parser.error(str(exc))
            print("wrote " + ", ".join(str(path) for path in drawn))
            return 0
        print(f"wrote {write_report(args.results, args.out)}")
        return 0
    try:
        max_drop = parse_max_drop(args.max_drop)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        comparison = compare_results(args.base, args.new, max_drop)
    except (OSError, ValueError) as exc:  # a missing or unreadable result is a usage error, not a regression
        parser.error(str(exc))
    print(comparison.markdown() if args.format == "markdown" else comparison.table())
    return comparison.exit_status()


if __name__ == "__main__":
    stop_servers_on_sigterm()  # the servers a command starts stop with it (`bench serve`'s outlive it once up)
    sys.exit(main())

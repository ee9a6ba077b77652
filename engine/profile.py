"""`python -m engine.profile --model DIR`: where the time of one decode step goes.

For each `--batch` (default 1, 64 and 256 sequences of `--context` ~1,024 prompt tokens) it fills one
engine, times decode steps (steady state: the pipeline's fill and drain cancelled), runs a few under
torch.profiler, and prints the step time; the bandwidth it achieves against the measured ceiling
(weights + KV read per step / step time, against a large device-to-device copy); the fraction of the
step's wall time the GPU is busy (the profiler's device time / the steady step's wall time) and the
kernel launches per step; the host's time per phase of the step (engine.timer: schedule, prepare,
...); and the top operators. `--json PATH` writes every figure. It drives the engine through its
public API only, and changes nothing.

`--prefill-chunk N` makes every timed step a mixed one, as under load: besides the batch's decodes
it carries a new prompt of N tokens (one request a step, generating one token, so the decode batch
stays the same). Mixed steps of up to `--mixed-graph-max-tokens` tokens replay a CUDA graph, as in
the server (0: eager); their GPU-busy fraction and launches per step say whether such a step waits on
the host's launches or on the GPU, and the top operators where the GPU's time goes. The device's idle
time between its operations is split into short gaps (one kernel after another) and longer ones (the
device waiting for the host).

`--context-mix 16,64,256,1024,4096` gives each sequence a prompt length drawn from that list (the
seed-mix workload's), as a closed loop's decodes hold them: a kernel whose time follows the longest
sequence shows it there, where uniform contexts hide it.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from engine import EngineArgs, LLMEngine, SamplingParams
from engine.kernels.ceilings import copy_bandwidth_gbs

DEFAULT_BATCHES = (1, 64, 256)
# Host calls that launch work on the device: a kernel each, or a whole CUDA graph (one launch).
LAUNCH_CALLS = frozenset(
    {
        "cudaLaunchKernel",
        "cudaLaunchKernelExC",
        "cudaLaunchCooperativeKernel",
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cudaGraphLaunch",
    }
)


def bytes_per_decode_step(engine: LLMEngine, contexts: Sequence[int]) -> int:
    """What one decode step must read at least: every weight once, and each sequence's K/V."""
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv = sum(contexts) * engine.model_config.kv_bytes_per_token(engine.dtype.itemsize)
    return weights + kv


def batch_contexts(batch: int, context: int, context_mix: Sequence[int]) -> list[int]:
    """Each sequence's prompt length: `context` for all, or with a context mix one drawn from it for
    each sequence (seeded by the batch size, so a run repeats), as a closed loop's decodes hold prompts
    of very different lengths side by side. Why: kernels whose time follows the longest sequence look
    fine at uniform contexts and are not (the decode attention of 2026-12-06, PERFORMANCE.md)."""
    if not context_mix:
        return [context] * batch
    generator, lengths = random.Random(batch), list(context_mix)
    return [generator.choice(lengths) for _ in range(batch)]


def device_figures(events: Iterable[Any], steps: int, step_s: float) -> dict[str, float]:
    """From the profiler's events over `steps` steps: the device's busy time per step (kernels and
    memory copies/sets, added up), its fraction of the step's wall time `step_s` (measured without
    the profiler), the kernels run and the host's launch calls (a CUDA graph's replay is one) per step."""
    busy_us = 0.0
    kernels = launches = 0
    for event in events:
        if event.device_type == DeviceType.CUDA:
            busy_us += event.time_range.elapsed_us()
            kernels += not event.name.startswith(("Memcpy", "Memset"))
        elif event.name in LAUNCH_CALLS:
            launches += 1
    busy_ms = busy_us / 1e3 / steps
    return {
        "gpu_busy_ms_per_step": busy_ms,
        "gpu_busy_fraction": busy_ms / (step_s * 1e3),
        "kernel_launches_per_step": launches / steps,
        "device_kernels_per_step": kernels / steps,
    }


# A gap between two device operations shorter than this is one kernel following another inside a
# graph replay or a launch queue (~1-3 us each); a longer one is the device waiting for the host.
SHORT_GAP_US = 5.0


def device_idle(events: Iterable[Any], steps: int, short_us: float = SHORT_GAP_US) -> dict[str, float]:
    """Where the device idles between its first and last operation of the profiled steps, per step: the
    gaps between operations (overlapping ones merged) shorter than `short_us`, which more kernels or
    fewer launches would change, and the longer ones, which a faster host would. Why: a step's
    wall time minus its busy time does not say which of the two it is."""
    spans = sorted(
        (event.time_range.start, event.time_range.end)
        for event in events
        if event.device_type == DeviceType.CUDA
    )
    short_us_total = long_us_total = 0.0
    short_count = long_count = 0
    if spans:
        reach = spans[0][1]
        for start, end in spans[1:]:
            gap = start - reach
            if gap > short_us:
                long_us_total += gap
                long_count += 1
            elif gap > 0:
                short_us_total += gap
                short_count += 1
            reach = max(reach, end)
    return {
        "short_gaps_ms_per_step": short_us_total / 1e3 / steps,
        "short_gaps_per_step": short_count / steps,
        "long_gaps_ms_per_step": long_us_total / 1e3 / steps,
        "long_gaps_per_step": long_count / steps,
    }


def top_operators(prof: Any, steps: int, on_cuda: bool, limit: int = 15) -> list[dict[str, Any]]:
    """The operators that took the most device time (CPU time on CPU), per step."""
    averages = list(prof.key_averages())
    key = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    averages.sort(key=lambda average: getattr(average, key), reverse=True)
    return [
        {
            "name": average.key,
            "calls_per_step": average.count / steps,
            "self_cpu_ms_per_step": average.self_cpu_time_total / 1e3 / steps,
            "self_device_ms_per_step": average.self_device_time_total / 1e3 / steps if on_cuda else None,
        }
        for average in averages[:limit]
    ]


def steady_step_seconds(timed_run: Callable[[int], float], steps: int, repeats: int = 2) -> float:
    """One step's wall time in steady decode: (T(2n) - T(n)) / n from timed runs of n and 2n steps,
    each the fastest of `repeats` runs.

    A run of n steps also pays, once, for filling the pipeline (the first step's scheduling and
    preparation while the GPU waits) and draining it (the wait for the last step in flight). Over the
    few steps a profile times that is several percent of a step (0.6 ms at 64 sequences over 5 steps
    of 2.6 ms); the difference of two runs cancels it, so the GPU-busy fraction is one of steady
    decode. A difference lost in noise (not positive) falls back to the longer run's mean. The fastest
    of repeated runs, since a run may pay once for something no steady step pays: a mixed step's
    kernels meet argument shapes the warm-up did not (a new decode count, a new split count) and
    Triton compiles a variant, for tenths of a second, mid-run.
    """
    short = min(timed_run(steps) for _ in range(repeats))
    long = min(timed_run(2 * steps) for _ in range(repeats))
    if long <= short:
        return long / (2 * steps)
    return (long - short) / steps


def profile_batch(
    engine: LLMEngine,
    batch: int,
    context: int,
    steps: int,
    max_model_len: int,
    trace: str | None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    prefill_chunk: int = 0,
    context_mix: Sequence[int] = (),
) -> tuple[dict[str, Any], Any]:
    """Fill the engine with `batch` sequences of `context` prompt tokens (or of lengths drawn from
    `context_mix`: batch_contexts), prefill them, time runs of
    `steps` and 2 x `steps` decode steps (steady_step_seconds), then profile `steps` more; abort them
    all at the end, so the next batch starts empty. Greedy unless `temperature` says otherwise (the
    sampled step's own costs: the sampler after the graph). With `prefill_chunk` > 0, a new prompt of
    that many tokens is added before each of those steps (while none waits), generating one token:
    mixed steps of the same decodes."""
    contexts = batch_contexts(batch, context, context_mix)
    fed: list[str] = []

    def feed() -> None:
        """A new prompt for the next step, unless one still waits (the budget was full)."""
        if prefill_chunk and not engine.scheduler.waiting:
            one_token = SamplingParams(max_tokens=1, temperature=temperature, top_p=top_p, ignore_eos=True)
            n = len(fed)
            fed.append(f"profile-{batch}-prompt-{n}")
            # Tokens of its own (no prefix cache hit): a shift of the sequence per prompt.
            engine.add_request(
                fed[-1], [1000 + (n * 131 + j * 7) % 29000 for j in range(prefill_chunk)], one_token
            )

    def step() -> None:
        feed()
        engine.step()

    request_ids = [f"profile-{batch}-{i}" for i in range(batch)]
    before = engine.stats()
    for i, (request_id, length) in enumerate(zip(request_ids, contexts, strict=True)):
        params = SamplingParams(
            max_tokens=max_model_len - length, temperature=temperature, top_p=top_p, ignore_eos=True
        )
        engine.add_request(request_id, [1000 + (i * 7 + j) % 29000 for j in range(length)], params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    # Prompts differ within a batch, but a later batch's repeat an earlier one's (the first of 64 is
    # the one of 1), whose blocks the prefix cache may still hold: its prefill is shorter, decode alike.
    # Counted before the warm-up, whose fed prompts (with a prefill chunk) are not the batch's.
    prefilled = engine.stats()
    for _ in range(3):
        step()  # warm-up decodes (mixed ones with a prefill chunk)
    queries = prefilled.prefix_cache_queries - before.prefix_cache_queries
    hit_rate = (prefilled.prefix_cache_hits - before.prefix_cache_hits) / queries if queries else 0.0
    on_cuda = engine.device.type == "cuda"
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)

    def timed_run(n: int) -> float:
        sync()
        engine.timer.reset()
        fed_before = len(fed)
        start = time.perf_counter()
        for _ in range(n):
            step()
        sync()
        elapsed = time.perf_counter() - start
        prompts_per_step.append((len(fed) - fed_before) / n)
        return elapsed

    prompts_per_step: list[float] = []
    step_s = steady_step_seconds(timed_run, steps)
    host = engine.timer.summary()  # over the last, longer run
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if on_cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        sync()
    for request_id in request_ids + fed:
        engine.abort(request_id)
    while engine.has_unfinished_requests():
        engine.step()  # the step in flight, and a fed prompt's last token
    if trace:
        prof.export_chrome_trace(trace)
    moved = bytes_per_decode_step(engine, contexts)
    figures: dict[str, Any] = {
        "batch": batch,
        "context": round(sum(contexts) / batch),  # the mean, with a context mix
        "context_mix": list(context_mix),
        "longest_context": max(contexts),
        "temperature": temperature,
        "top_p": top_p,
        "step_ms": step_s * 1e3,
        "tok_s": batch / step_s,  # decode tokens
        "prefill_chunk": prefill_chunk,
        # prompt tokens a timed step carried (the longer run): prefill_chunk while one fits a step
        "prompt_tokens_per_step": prefill_chunk * prompts_per_step[-1],
        "bytes_per_step": moved,
        "achieved_gbs": moved / step_s / 1e9,
        # engine.timer over the timed steps: where the host's time goes (`execute` includes the wait
        # for the GPU: the sampled tokens are read back at its end)
        "host_ms": {key: value for key, value in host.items() if key.endswith("_ms")},
        "prepare_ms": host.get("prepare_ms"),
        "prefix_cache_hit_rate": hit_rate,  # of this batch's prompt tokens, found cached
        "gpu_busy_ms_per_step": None,
        "gpu_busy_fraction": None,
        "kernel_launches_per_step": None,
        "device_kernels_per_step": None,
        "short_gaps_ms_per_step": None,
        "short_gaps_per_step": None,
        "long_gaps_ms_per_step": None,
        "long_gaps_per_step": None,
    }
    if on_cuda:
        events = prof.events()
        figures.update(device_figures(events, steps, step_s))
        figures.update(device_idle(events, steps))
    figures["top_operators"] = top_operators(prof, steps, on_cuda)
    return figures, prof


def report(figures: dict[str, Any], ceiling_gbs: float | None) -> list[str]:
    """The lines printed for one batch."""
    batch, step_ms = figures["batch"], figures["step_ms"]
    contexts = f"~{figures['context']} tokens"
    if figures.get("context_mix"):
        contexts = f"{figures['context']} tokens on average, {figures['longest_context']} the longest"
    lines = [
        f"decode step: {step_ms:.2f} ms for {batch} sequences of {contexts} ({figures['tok_s']:.0f} tok/s)"
    ]
    if figures["prefill_chunk"]:
        lines[0] = (
            f"mixed step: {step_ms:.2f} ms for {batch} decodes of {contexts} and "
            f"{figures['prompt_tokens_per_step']:.0f} prompt tokens ({figures['tok_s']:.0f} decode tok/s)"
        )
    moved_gb, achieved = figures["bytes_per_step"] / 1e9, figures["achieved_gbs"]
    if ceiling_gbs:
        lines.append(
            f"  moved >= {moved_gb:.2f} GB per step: {achieved:.0f} GB/s, {100 * achieved / ceiling_gbs:.1f}% of the measured copy bandwidth {ceiling_gbs:.0f} GB/s"
        )
    else:
        lines.append(f"  moved >= {moved_gb:.3f} GB per step: {achieved:.1f} GB/s")
    if figures["gpu_busy_fraction"] is not None:
        lines.append(
            f"  GPU busy {figures['gpu_busy_ms_per_step']:.2f} ms per step: {100 * figures['gpu_busy_fraction']:.1f}% of the step's wall time; "
            f"{figures['kernel_launches_per_step']:.0f} kernel launches per step ({figures['device_kernels_per_step']:.0f} kernels ran)"
        )
        lines.append(
            f"  GPU idle between operations {figures['short_gaps_ms_per_step'] + figures['long_gaps_ms_per_step']:.2f} ms "
            f"per step: {figures['short_gaps_ms_per_step']:.2f} ms in {figures['short_gaps_per_step']:.0f} gaps under "
            f"{SHORT_GAP_US:.0f} us (one kernel after another), {figures['long_gaps_ms_per_step']:.2f} ms in "
            f"{figures['long_gaps_per_step']:.0f} longer ones (waiting for the host)"
        )
    else:
        lines.append("  GPU busy: - (no CUDA device: no device figures)")
    phases = ", ".join(
        f"{name.removesuffix('_ms')} {value:.2f}"
        for name, value in figures["host_ms"].items()
        if name != "step_ms"
    )
    lines.append(f"  host per step (ms): {phases}; prepare a step {figures['prepare_ms']:.2f} ms")
    lines.append(
        f"  prefix cache: {100 * figures['prefix_cache_hit_rate']:.1f}% of the prompt tokens found cached"
    )
    return lines


def _trace_path(trace: str | None, batch: int, batches: Sequence[int]) -> str | None:
    if not trace or len(batches) == 1:
        return trace
    path = Path(trace)
    return str(path.with_name(f"{path.stem}-b{batch}{path.suffix}"))


def _positive_ints(text: str, what: str) -> tuple[int, ...]:
    try:
        values = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list of {what}, got {text!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"{what} must be >= 1, got {text!r}")
    return values


def _batches(text: str) -> tuple[int, ...]:
    return _positive_ints(text, "batch sizes")


def _lengths(text: str) -> tuple[int, ...]:
    return _positive_ints(text, "prompt lengths")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(prog="python -m engine.profile", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--batch",
        type=_batches,
        default=DEFAULT_BATCHES,
        help="sequences per step, a comma list (default 1,64,256)",
    )
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens of each sequence")
    parser.add_argument(
        "--context-mix",
        type=_lengths,
        default=(),
        help="prompt lengths, a comma list: each sequence draws one (e.g. the seed-mix's "
        "16,64,256,1024,4096), instead of --context for all",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=10,
        help="decode steps: runs of this many and twice as many timed, then this many profiled",
    )
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampled steps"
    )
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling (with --temperature)")
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=0,
        help="prompt tokens added to every timed step (mixed steps); 0: decode steps only",
    )
    parser.add_argument(
        "--mixed-graph-max-tokens",
        type=int,
        default=EngineArgs.mixed_graph_max_tokens,
        help="mixed steps up to this many tokens replay CUDA graphs; 0: eager (default: %(default)s)",
    )
    parser.add_argument(
        "--mixed-graph-ladder-steps",
        type=int,
        default=EngineArgs.mixed_graph_ladder_steps,
        help="graph sizes for mixed steps from each power of two tokens to the next (default: %(default)s)",
    )
    parser.add_argument(
        "--max-num-seqs",
        type=int,
        help="the engine's sequence cap (default: the largest batch, at least 256, plus one for a fed prompt); "
        "a mixed graph gives the decode kernel this many rows, so the server's 1,024 costs more empty ones",
    )
    parser.add_argument("--max-model-len", type=int, default=4352)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--trace", help="write a Chrome trace here (one a batch: NAME-bB.json)")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--no-tables", action="store_true", help="leave out the top-operator tables")
    args = parser.parse_args(argv)
    longest = max(args.context_mix or (args.context,))
    if longest >= args.max_model_len:
        parser.error(
            f"a prompt of {longest} tokens leaves no room to decode within --max-model-len {args.max_model_len}"
        )
    engine = LLMEngine(
        EngineArgs(
            model=args.model,
            max_model_len=args.max_model_len,
            # one more than the largest batch: a mixed step's new prompt needs a sequence slot
            max_num_seqs=args.max_num_seqs or max(256, *args.batch) + (1 if args.prefill_chunk else 0),
            dtype=args.dtype,
            mixed_graph_max_tokens=args.mixed_graph_max_tokens,
            mixed_graph_ladder_steps=args.mixed_graph_ladder_steps,
        )
    )
    ceiling = copy_bandwidth_gbs(engine.device) if engine.device.type == "cuda" else None
    results = []
    for batch in args.batch:
        figures, prof = profile_batch(
            engine,
            batch,
            args.context,
            args.steps,
            args.max_model_len,
            _trace_path(args.trace, batch, args.batch),
            args.temperature,
            args.top_p,
            args.prefill_chunk,
            args.context_mix,
        )
        figures["ceiling_fraction"] = figures["achieved_gbs"] / ceiling if ceiling else None
        results.append(figures)
        print("\n".join(report(figures, ceiling)))
        if not args.no_tables:
            sort = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
            print(prof.key_averages().table(sort_by=sort, row_limit=25))
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    out = {
        "model": args.model,
        "device": str(engine.device),
        "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "context": args.context,
        "context_mix": list(args.context_mix),
        "prefill_chunk": args.prefill_chunk,
        "steps": args.steps,
        "copy_ceiling_gbs": ceiling,
        "config": engine.config_dict(),
        "batches": results,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {args.json}")
    return out


if __name__ == "__main__":
    main()

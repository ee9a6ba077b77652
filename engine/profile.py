"""`python -m engine.profile --model DIR`: where the time of one decode step goes.

Fills the engine with `--batch` requests of `--context` prompt tokens, runs a few decode steps under
torch.profiler, and prints the step time, the bandwidth it achieves against the measured ceiling
(weights + KV read per step / step time, against a large device-to-device copy), and the top
operators. Used to decide what to speed up next; it changes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import EngineArgs, LLMEngine, SamplingParams


def copy_bandwidth_gbs(device: torch.device, size_bytes: int = 2 << 30) -> float:
    """The memory ceiling: a large device-to-device copy, bytes read plus bytes written, per second."""
    src = torch.empty(size_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    repeats = 20
    for _ in range(repeats):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize(device)
    return 2 * size_bytes * repeats / (start.elapsed_time(end) / 1e3) / 1e9


def bytes_per_decode_step(engine: LLMEngine, batch: int, context: int) -> int:
    """What one decode step must read at least: every weight once, and each sequence's K/V."""
    weights = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv = batch * context * engine.model_config.kv_bytes_per_token(engine.dtype.itemsize)
    return weights + kv


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine.profile", description=__doc__)
    parser.add_argument("--model", required=True)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--max-model-len", type=int, default=4352)
    parser.add_argument("--trace", help="write a Chrome trace here")
    args = parser.parse_args(argv)
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=args.max_model_len))
    params = SamplingParams(max_tokens=args.max_model_len - args.context, temperature=0.0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), [1000 + (i * 7 + j) % 29000 for j in range(args.context)], params)
    while any(s.num_uncomputed_tokens > 1 for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()  # prefill
    for _ in range(3):
        engine.step()  # warm-up decodes
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    sync()
    step_s = (time.perf_counter() - start) / args.steps
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            engine.step()
        sync()
    print(
        f"decode step: {step_s * 1e3:.2f} ms for {args.batch} sequences of ~{args.context} tokens ({args.batch / step_s:.0f} tok/s)"
    )
    moved = bytes_per_decode_step(engine, args.batch, args.context)
    achieved = moved / step_s / 1e9
    if engine.device.type == "cuda":
        ceiling = copy_bandwidth_gbs(engine.device)
        print(
            f"moved >= {moved / 1e9:.2f} GB per step: {achieved:.0f} GB/s, {100 * achieved / ceiling:.1f}% of the measured copy bandwidth {ceiling:.0f} GB/s"
        )
    else:
        print(f"moved >= {moved / 1e9:.3f} GB per step: {achieved:.1f} GB/s")
    sort = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()

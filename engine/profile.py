"""`python -m engine.profile --model DIR`: where the time of one decode step goes.

Fills the engine with `--batch` requests of `--context` prompt tokens, runs a few decode steps under
torch.profiler, and prints the step time, the split between host work and device kernels, and the
top operators. Used to decide what to speed up next; it changes nothing.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import EngineArgs, LLMEngine, SamplingParams


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
    params = SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
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
    sort = "cuda_time_total" if engine.device.type == "cuda" else "cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=25))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))
    if args.trace:
        prof.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()

"""Micro-benchmark of sampling: the fused draw against torch, and the methods that find top-p's cutoff.

`python -m engine.kernels.bench_sampling [--json PATH] [--rows 1 64 256]`: float32 logits over
qwen2.5's vocabulary (151,936) on CUDA, at 1, 64 and 256 rows, in two shapes: flat (randn: top-p
0.9 keeps most of the vocabulary) and peaked (the top 50 tokens hold ~95% of the mass, as a trained
model's usually do). Each case is timed launched eagerly from Python (how the runner samples, after the
forward pass; launch overhead included) and, where it can be captured, replayed from a CUDA graph
(device time). Cases:

- temperature: `kernel` (engine/kernels/sampling.py), `torch` (its reference on the GPU),
  `multinomial` (softmax, then one batched torch.multinomial), `legacy` (the sampler before: a full
  sort, then torch.multinomial row by row with a generator each);
- top_p=0.9 alone: each candidate FilterMethod (sort, prefix of 256/1024/4096 with the bisection
  kernel for the rows the prefix cannot settle, bisect), cutoff then draw;
- top_k=50 with top_p=0.9 (torch.topk, top-p within it) and the sort method;
- min_p=0.05 (arithmetic: no candidates);
- parts: torch.topk, the sort, the row mass in torch, and the top-p search kernel alone
  (top_p_cutoffs over every row);
- sampler: the engine's Sampler end to end (host staging and upload, then the draw) at temperature 1.0
  and at top_p 0.9 with the default method, and with presence, frequency and repetition penalties.

Pick FILTER_METHOD in engine/sampler.py from the top_p rows: the fastest on the peaked shape that is
not much slower on the flat one; `--rows 1 2 4 8 16 32` places sort_rows (below it, the sort wins).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import triton

from engine.kernels.sampling import sample_rows, top_p_cutoffs
from engine.kernels.sampling_reference import sample_reference
from engine.kernels.timing import eager_ms, graph_ms
from engine.sampler import FILTER_METHOD, FilterMethod, Sampler, SamplerConfig, filter_cutoffs
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

VOCAB = 151_936
ROW_COUNTS = (1, 64, 256)
PEAK_TOKENS, PEAK_MASS = 50, 0.95
TOP_P, TOP_K, MIN_P = 0.9, 50, 0.05
TOP_P_METHODS = [  # sort_rows=0: each method as itself at every batch size
    FilterMethod("sort"),
    FilterMethod("prefix", 256, sort_rows=0),
    FilterMethod("prefix", 1024, sort_rows=0),
    FilterMethod("prefix", 4096, sort_rows=0),
    FilterMethod("bisect", sort_rows=0),
]
EAGER_REPEATS = 20


@dataclass
class Result:
    case: str
    method: str
    shape: str
    rows: int
    eager_us: float
    graph_us: float | None  # None: the case cannot be captured in a CUDA graph


def peaked_logits(rows: int, generator: torch.Generator) -> torch.Tensor:
    """randn rows with PEAK_TOKENS random tokens raised so that they hold PEAK_MASS of the softmax."""
    logits = torch.randn(rows, VOCAB, generator=generator, dtype=torch.float64)
    top = torch.rand(rows, VOCAB, generator=generator).topk(PEAK_TOKENS, dim=-1).indices
    in_top = torch.zeros(rows, VOCAB, dtype=torch.bool).scatter_(1, top, True)
    top_mass = logits.exp().masked_fill(~in_top, 0).sum(-1)
    tail_mass = logits.exp().masked_fill(in_top, 0).sum(-1)
    boost = torch.log(PEAK_MASS / (1 - PEAK_MASS) * tail_mass / top_mass)
    return (logits + boost[:, None] * in_top).float()


def make_logits(shape: str, rows: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows)
    if shape == "flat":
        return torch.randn(rows, VOCAB, generator=generator).cuda()
    return peaked_logits(rows, generator).cuda()


def legacy_sample(logits: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """The sampler this replaced, temperature 1 and no filters: a full sort, then a draw a row."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    restored = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = restored.softmax(dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, generator in enumerate(generators):
        tokens[i] = torch.multinomial(probs[i], 1, generator=generator)[0]
    return tokens


def draw_cases(logits: torch.Tensor) -> list[tuple[str, str, Callable[[], object], bool]]:
    """(case, method, call, capturable) at temperature 1."""
    rows = logits.shape[0]
    device = logits.device
    temperature = torch.ones(rows, device=device)
    key_lo = torch.arange(rows, dtype=torch.int32, device=device)
    key_hi = torch.zeros(rows, dtype=torch.int32, device=device)
    position = torch.full((rows,), 17, dtype=torch.int32, device=device)
    out = torch.empty(rows, dtype=torch.int64, device=device)
    generators = [torch.Generator(device=device).manual_seed(i) for i in range(rows)]
    top_k = torch.full((rows,), TOP_K, dtype=torch.int32, device=device)
    no_top_k = torch.full((rows,), VOCAB, dtype=torch.int32, device=device)
    top_p = torch.full((rows,), TOP_P, device=device)
    no_top_p = torch.ones(rows, device=device)
    min_p = torch.full((rows,), MIN_P, device=device)
    no_min_p = torch.zeros(rows, device=device)

    def filtered(k, p, m, k_max: int, alone: bool, method: FilterMethod) -> Callable[[], object]:
        def call() -> object:
            cutoff = filter_cutoffs(
                logits, key_lo, temperature, k, p, m, k_max=k_max, top_p_alone=alone, method=method
            )
            return sample_rows(logits, temperature, key_lo, key_hi, position, cutoff=cutoff, out=out)

        return call

    cases: list[tuple[str, str, Callable[[], object], bool]] = [
        (
            "temperature",
            "kernel",
            lambda: sample_rows(logits, temperature, key_lo, key_hi, position, out=out),
            True,
        ),
        (
            "temperature",
            "torch",
            lambda: sample_reference(logits, temperature, None, key_lo, key_hi, position),
            True,
        ),
        ("temperature", "multinomial", lambda: torch.multinomial(logits.softmax(-1), 1), True),
        ("temperature", "legacy", lambda: legacy_sample(logits, generators), False),
    ]
    for method in TOP_P_METHODS:
        name = method.top_p if method.top_p != "prefix" else f"prefix-{method.prefix}"
        cases.append((f"top_p={TOP_P}", name, filtered(no_top_k, top_p, no_min_p, 0, True, method), True))
    for method in (FilterMethod("prefix", sort_rows=0), FilterMethod("sort")):
        name = "topk" if method.top_p != "sort" else "sort"
        cases.append(
            (
                f"top_k={TOP_K},top_p={TOP_P}",
                name,
                filtered(top_k, top_p, no_min_p, TOP_K, False, method),
                True,
            )
        )
    cases.append(
        (f"min_p={MIN_P}", "threshold", filtered(no_top_k, no_top_p, min_p, 0, False, FILTER_METHOD), True)
    )
    # The parts of the top-p methods, to see where their time goes.
    top = logits.amax(dim=-1, keepdim=True)
    index = torch.arange(rows, dtype=torch.int32, device=device)
    every_row = torch.ones(rows, dtype=torch.int32, device=device)
    no_lower = torch.full((rows,), float("-inf"), device=device)
    cutoff = torch.empty(rows, device=device)
    cases += [
        ("parts", "topk-256", lambda: logits.topk(256, dim=-1), True),
        ("parts", "topk-1024", lambda: logits.topk(1024, dim=-1), True),
        ("parts", "sort", lambda: logits.sort(dim=-1, descending=True), True),
        ("parts", "row-mass", lambda: (logits - top).div_(temperature[:, None]).exp_().sum(dim=-1), True),
        (
            "parts",
            "top-p-search",  # the k-ary search alone, every row flagged, the rows' maxima given
            lambda: top_p_cutoffs(
                logits, index, temperature, top_p, no_lower, every_row, cutoff, top=top[:, 0]
            ),
            True,
        ),
    ]
    return cases


def _end_to_end(sampler: Sampler, seqs: list[Sequence], logits: torch.Tensor) -> Callable[[], object]:
    return lambda: sampler.sample(logits, sampler.prepare(seqs))


def sampler_cases(logits: torch.Tensor) -> list[tuple[str, str, Callable[[], object], bool]]:
    """The Sampler end to end (host staging + upload + draw), as the runner calls it each step."""
    rows = logits.shape[0]
    cases: list[tuple[str, str, Callable[[], object], bool]] = []
    for name, params in (
        ("temperature", SamplingParams(temperature=1.0)),
        (f"top_p={TOP_P}", SamplingParams(temperature=1.0, top_p=TOP_P)),
        (
            "penalties",
            SamplingParams(
                temperature=1.0, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1
            ),
        ),
    ):
        sampler = Sampler(SamplerConfig(VOCAB, max(rows, 1), logits.device))
        seqs = [Sequence(i, str(i), list(range(100, 400)), params) for i in range(rows)]
        for seq in seqs:
            seq.output_token_ids = list(range(500, 600))
        work = logits.clone()
        cases.append(("sampler", name, _end_to_end(sampler, seqs, work), False))
    return cases


def run(row_counts: tuple[int, ...]) -> list[Result]:
    results = []
    with torch.inference_mode():
        for shape in ("flat", "peaked"):
            for rows in row_counts:
                logits = make_logits(shape, rows)
                for case, method, call, capturable in draw_cases(logits) + sampler_cases(logits):
                    graph = None
                    if capturable:
                        try:
                            graph = 1000 * graph_ms([call], rounds=5, replays=5)
                        except (
                            RuntimeError
                        ) as error:  # a call that syncs or allocates in a way capture refuses
                            print(f"  ({case} {method}: not capturable: {str(error).splitlines()[0]})")
                            torch.cuda.synchronize()
                    eager = 1000 * eager_ms(call, EAGER_REPEATS)
                    results.append(Result(case, method, shape, rows, eager, graph))
                    print_row(results[-1])
                del logits
                torch.cuda.empty_cache()
    return results


def print_row(result: Result) -> None:
    graph = "-" if result.graph_us is None else f"{result.graph_us:.1f}"
    print(
        f"{result.shape:<8}{result.rows:>6}  {result.case:<22}{result.method:<14}"
        f"{result.eager_us:>11.1f}{graph:>11}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Time the sampling kernels and top-p methods on CUDA.")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROW_COUNTS), help="batch sizes")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "bench_sampling needs a CUDA device (it times GPU kernels); none is visible here.",
            file=sys.stderr,
        )
        return 1
    device_name = torch.cuda.get_device_name()
    peaked = torch.softmax(peaked_logits(1, torch.Generator().manual_seed(0)).double(), -1)
    top_mass = peaked.topk(PEAK_TOKENS).values.sum().item()
    print(
        f"{device_name}, vocab {VOCAB}, float32 logits; peaked: top {PEAK_TOKENS} tokens hold {top_mass:.3f}"
    )
    print(
        "eager: microseconds a call launched from Python (as the runner samples); graph: replayed (device time)"
    )
    print(f"{'shape':<8}{'rows':>6}  {'case':<22}{'method':<14}{'eager us':>11}{'graph us':>11}")
    results = run(tuple(args.rows))
    if args.json:
        report = {
            "device": device_name,
            "torch": torch.__version__,
            "triton": triton.__version__,
            "vocab": VOCAB,
            "peaked_top_mass": top_mass,
            "default_method": asdict(FILTER_METHOD),
            "results": [asdict(result) for result in results],
        }
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2, allow_nan=False)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

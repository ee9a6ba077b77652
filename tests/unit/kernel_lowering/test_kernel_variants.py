"""A serving step never meets an attention kernel variant that the engine's start-up has not compiled.

Why: Triton compiles a kernel once per *variant*: its constexprs, and a specialisation of each other
argument (an integer equal to 1 or divisible by 16, a pointer aligned to 16 bytes) unless the kernel
opts out. A variant first met while serving compiles then, on the engine's loop, and stalls every
request: on a fresh H100 the decode plan kernel compiled about ten times in closed loops of 8 to 256
in flight (once per row-count bucket, and again as a count became 1 or a multiple of 16), and the
first trial at 8 in flight made 2,280 output tok/s against 2,978 and 2,811 once they were cached.
So the attention kernels specialise nothing that follows the step's shape (row counts, split counts,
where a step's chunks start in the step buffers), and the plan kernel's one shape-dependent constexpr
takes the buckets the decode graphs' capture meets (16 rows and up, a power of two).

Here the engine runs on CPU through the Triton backend with every kernel replaced by a recorder (none
runs; the outputs are zeros, the steps real), and each launch's variant is computed by Triton's own
argument binder for an sm_90 target, as a CUDA launch would compute it. Runs without TRITON_INTERPRET
(the interpreter's kernels have no binder), in the ordinary unit step.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from sm90 import KERNEL_MODULES, TARGET, jit_kernels
from triton.compiler.compiler import make_backend
from triton.runtime.jit import create_function_from_signature

from engine import LLM, SamplingParams
from engine.attention.triton_backend import PLANNED_MIN_DECODES
from engine.cuda_graphs import batch_size_ladder
from engine.kernels.planned_decode_attention import plan_rows_block

BACKEND = make_backend(TARGET)


class VariantRecorder:
    """Stands in for a kernel object: `kernel[grid](*args, **kwargs)` records the variant Triton would
    compile for these arguments (its specialisation and options, with the launch's constexprs), and
    runs nothing but zeroing the output."""

    def __init__(self, kernel, module, variants: dict[str, dict]) -> None:
        self.name = f"{module.__name__.rsplit('.', 1)[-1]}.{kernel.__name__}"
        self.constexprs = [param.name for param in kernel.params if param.is_constexpr]
        self.binder = create_function_from_signature(kernel.signature, kernel.params, BACKEND)
        self.variants = variants

    def __getitem__(self, grid):
        def launch(*args, **kwargs) -> None:
            params, specialization, options = self.binder(*args, **kwargs)
            key = (repr(specialization), repr(sorted(options.items())))
            self.variants[self.name][key] = {name: params[name] for name in self.constexprs}
            if "out_ptr" in params:  # every kernel's output: zeros, so that the engine's steps go on alike
                params["out_ptr"].zero_()

        return launch


@pytest.fixture
def variants(monkeypatch) -> dict[str, dict]:
    """kernel ("module.name") -> {variant: its constexprs}, for every launch from now on."""
    seen: dict[str, dict] = defaultdict(dict)
    # The model's elementwise kernels and matmul too: on CPU they would otherwise try to launch.
    for module in KERNEL_MODULES:
        for key, kernel in jit_kernels(module).items():
            monkeypatch.setattr(module, key, VariantRecorder(kernel, module, seen))
    return seen


PLAN = "planned_decode_attention._decode_plan_kernel"
SPLIT = "planned_decode_attention._decode_split_kernel"
PREFILL = "prefill_attention._prefill_kernel"
# Every kernel an eager step may launch, and its variants at most whatever the step: by design, a
# constexpr that is not the step's shape (RMSNorm with or without the residual add). A kernel missing
# here fails the test until its variants are accounted for. The one-split-count decode kernel and its
# merge run decode-only steps of a few rows, which CUDA graphs replay (each graph's split count fixed at
# capture); they run eagerly only under enforce_eager, and are left out.
MOST_VARIANTS = {
    SPLIT: 1,
    PREFILL: 1,
    "rotary._rotary_store_kv_kernel": 1,
    "kv_cache._store_kv_kernel": 1,
    "norm._rms_norm_kernel": 2,
    "activation._silu_and_mul_kernel": 1,
    "gemv._gemv_kernel": 1,
}
GRAPHED_ONLY = {"decode_attention._decode_split_kernel", "decode_attention._decode_merge_kernel"}


def test_a_closed_loop_meets_one_variant_of_each_attention_kernel(tiny_model_dir, variants):
    """Steps of every kind, eagerly: decodes alone, decodes beside prompt chunks (1 to ~26 rows) that
    start anywhere in the step buffers, short contexts (one split: the split kernel's direct path) and
    long ones (several)."""
    llm = LLM(
        str(tiny_model_dir),
        device="cpu",
        dtype="float32",
        attention_backend="triton",
        max_model_len=1024,
        max_num_seqs=40,
        max_num_batched_tokens=160,
        block_size=16,
        enforce_eager=True,
    )
    rng = random.Random(0)
    lengths = [rng.choice((3, 17, 60, 130, 700)) for _ in range(64)]
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in lengths]
    params = [
        SamplingParams(max_tokens=rng.randrange(2, 60), temperature=0.0, ignore_eos=True) for _ in prompts
    ]
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]

    # One variant a bucket of rows: 16 for 1-16 rows, 32 for 17-32, 64 for 33-40 (if a step had them).
    # Specialised on the counts, this loop met 8 plan, 4 split and 2 prefill variants.
    blocks = [constexprs["BLOCK_R"] for constexprs in variants[PLAN].values()]
    assert sorted(blocks) == sorted(set(blocks)) and {16, 32} <= set(blocks) <= {16, 32, 64}, blocks
    # The loop's first step is prompts alone, as the start-up's profile run is: the prefill kernel's one
    # variant is the one that run compiles on CUDA.
    for name in (SPLIT, PREFILL, "rotary._rotary_store_kv_kernel"):
        assert len(variants[name]) == 1, (name, sorted(variants[name]))
    for name, found in variants.items():
        if name not in GRAPHED_ONLY and name != PLAN:
            assert name in MOST_VARIANTS, f"{name}: its variants are not accounted for"
            assert len(found) <= MOST_VARIANTS[name], (name, sorted(found))


@pytest.mark.parametrize("max_num_seqs", [16, 17, 40, 64, 100, 256, 1000, 1024, 2048])
def test_the_decode_graphs_meet_every_plan_bucket(max_num_seqs):
    """With CUDA graphs, the decode graphs of 16 rows and up (the planned kernel's, PLANNED_MIN_DECODES)
    meet every bucket a step of 1 to max_num_seqs decodes plans in: the capture compiles them all."""
    captured = {plan_rows_block(b) for b in batch_size_ladder(max_num_seqs) if b >= PLANNED_MIN_DECODES}
    served = {plan_rows_block(n) for n in range(1, max_num_seqs + 1)}
    assert served == captured

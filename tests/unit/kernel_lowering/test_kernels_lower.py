"""Every Triton kernel lowers to Triton IR for an H100/H200 (sm_90) at the model's shapes, in bf16.

Why: the kernel tests run on CPU through Triton's interpreter, which executes a kernel's Python without
the compiler's front end, and in float32/float16 only (it computes bf16 wrongly on CPU). A kernel the
front end refuses (a name bound again to another shape inside an `if`, say) passes them and fails on
the device. Here each public launcher is called with CPU tensors at the shapes the engine uses, its
kernel object replaced by a recorder, so nothing runs: the recorded arguments give the kernel's
signature and constexprs, and Triton's front end lowers it for sm_90 (no GPU needed, no code
generation past Triton IR). Runs in the ordinary unit-test process: under TRITON_INTERPRET=1 the
kernels are interpreter objects and these tests skip.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from sm90 import TARGET, jit_kernels, triton
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend

from engine.kernels import (
    activation,
    decode_attention,
    gemv,
    kv_cache,
    norm,
    planned_decode_attention,
    prefill_attention,
    rotary,
    sampling,
)

POINTER_TYPES = {
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.float32: "*fp32",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int8: "*i8",
    torch.uint8: "*u8",
    torch.bool: "*i1",
}


class Recorder:
    """Stands in for a kernel object: `kernel[grid](*args, **kwargs)` records the call, runs nothing."""

    def __init__(self) -> None:
        self.calls: list[tuple[tuple, dict]] = []

    def __getitem__(self, grid):
        def record(*args, **kwargs) -> None:
            self.calls.append((args, kwargs))

        return record


def lower(kernel, args: tuple, kwargs: dict) -> str:
    """Triton IR of kernel for sm_90, specialised as a launch with these arguments would be."""
    names = kernel.arg_names
    values = dict(zip(names, args, strict=False)) | {k: v for k, v in kwargs.items() if k in names}
    options = {k: v for k, v in kwargs.items() if k not in names}  # num_warps, num_stages
    constexprs, signature = {}, {}
    for param in kernel.params:
        value = values[param.name]
        if param.is_constexpr:
            constexprs[param.name] = value
            signature[param.name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[param.name] = POINTER_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[param.name] = "i1"
        elif isinstance(value, int) and value == 1 and not getattr(param, "do_not_specialize", False):
            constexprs[param.name] = 1  # as a launch specialises an integer argument of 1
            signature[param.name] = "constexpr"
        elif isinstance(value, int):
            signature[param.name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[param.name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: no Triton type for {param.name}={value!r}")
    backend = make_backend(TARGET)
    parsed = backend.parse_options(options)
    context = triton._C.libtriton.ir.context()
    triton._C.libtriton.ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(kernel, signature, constexprs).make_ir(
        TARGET, parsed, backend.get_codegen_implementation(parsed), backend.get_module_map(), context
    )
    return str(module)


def lowers(module, name: str, launch: Callable[[], object]) -> list[str]:
    """Triton IR of each launch of module.name that `launch` makes, with every kernel of the module
    replaced by a recorder meanwhile (so that none runs)."""
    kernels = jit_kernels(module)
    recorders = {key: Recorder() for key in kernels}
    with pytest.MonkeyPatch.context() as patch:
        for key, recorder in recorders.items():
            patch.setattr(module, key, recorder)
        launch()
    assert recorders[name].calls, f"{module.__name__}.{name} was never launched"
    return [lower(kernels[name], args, kwargs) for args, kwargs in recorders[name].calls]


BF16 = torch.bfloat16
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 12, 2, 128, 16  # qwen2.5-1.5b


def paged_inputs(lens: list[int], tokens: int):
    """query [tokens, 12, 128] bf16, the cache's key and value views, block tables and lengths (int32)."""
    blocks = sum(-(-length // BLOCK_SIZE) for length in lens) + 1
    cache = torch.zeros(2, blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=BF16)
    tables = torch.zeros(len(lens), max(-(-length // BLOCK_SIZE) for length in lens), dtype=torch.int32)
    query = torch.zeros(tokens, HEADS, HEAD_DIM, dtype=BF16)
    return query, cache[0], cache[1], tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("num_splits", [1, 4, 16])
def test_decode_kernels_lower(num_splits):
    """The one-split-count kernel (direct output, or splits and a merge launch) and the planned kernel
    (its plan, and splits of which a row's last merges it), as the engine launches them."""
    lens = [4352, 16, 1000, 0]
    query, keys, values, tables, seq_lens = paged_inputs(lens, len(lens))
    args = (query, keys, values, tables, seq_lens, HEAD_DIM**-0.5, num_splits)
    one_count = decode_attention

    def launch() -> None:
        one_count.paged_decode_attention(*args)

    assert all("tt.dot" in ir for ir in lowers(one_count, "_decode_split_kernel", launch))
    if num_splits > 1:
        lowers(one_count, "_decode_merge_kernel", launch)
    planned = planned_decode_attention

    def launch_planned() -> None:  # without a plan: the launcher plans first (both kernels recorded)
        planned.planned_decode_attention(*args)

    lowers(planned, "_decode_plan_kernel", launch_planned)
    assert all("tt.atomic_rmw" in ir for ir in lowers(planned, "_decode_split_kernel", launch_planned))


def test_prefill_attention_lowers():
    """Two prompt chunks over a cached prefix and a fresh prompt."""
    query, keys, values, tables, seq_lens = paged_inputs([1500, 700], 1024 + 300)
    starts = torch.tensor([0, 1024, 1324], dtype=torch.int32)
    launch = lambda: prefill_attention.paged_prefill_attention(  # noqa: E731
        query, keys, values, tables, starts, seq_lens, HEAD_DIM**-0.5, 1024
    )
    assert all("tt.dot" in ir for ir in lowers(prefill_attention, "_prefill_kernel", launch))


def test_rotary_and_cache_store_lower():
    """Rotary in place, rotary fused with the K/V store, and the store alone, on views of one qkv."""
    tokens = 256
    qkv = torch.zeros(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=BF16)
    query, key, value = qkv.split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], dim=-1)
    query = query.view(tokens, HEADS, HEAD_DIM)
    key, value = key.view(tokens, KV_HEADS, HEAD_DIM), value.view(tokens, KV_HEADS, HEAD_DIM)
    cos_sin = torch.zeros(4096, HEAD_DIM, dtype=torch.float32)
    positions = torch.arange(tokens)
    cache = torch.zeros(2, 32, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=BF16)
    slots = torch.arange(tokens)
    lowers(rotary, "_rotary_kernel", lambda: rotary.apply_rotary(query, key, cos_sin, positions))
    lowers(
        rotary, "_rotary_store_kv_kernel",
        lambda: rotary.rotary_store_kv(query, key, value, cos_sin, positions, cache[0], cache[1], slots),
    )  # fmt: skip
    lowers(kv_cache, "_store_kv_kernel", lambda: kv_cache.store_kv(key, value, cache[0], cache[1], slots))


def test_norm_activation_and_skinny_matmul_lower():
    """RMSNorm alone and with the residual, silu * mul, and the skinny matmul for qwen2.5-1.5b's
    projections (down_proj's with silu * mul on its input)."""
    hidden, inter = 1536, 8960
    x, residual = torch.zeros(8, hidden, dtype=BF16), torch.zeros(8, hidden, dtype=BF16)
    weight = torch.zeros(hidden, dtype=BF16)
    lowers(norm, "_rms_norm_kernel", lambda: norm.rms_norm(x, weight, 1e-6))
    lowers(norm, "_rms_norm_kernel", lambda: norm.fused_add_rms_norm(x, residual, weight, 1e-6))
    gate_up = torch.zeros(8, 2 * inter, dtype=BF16)
    lowers(activation, "_silu_and_mul_kernel", lambda: activation.silu_and_mul(gate_up))
    qkv_weight, qkv_bias = torch.zeros(2048, hidden, dtype=BF16), torch.zeros(2048, dtype=BF16)
    lowers(gemv, "_gemv_kernel", lambda: gemv.gemv(x, qkv_weight, qkv_bias))
    down = torch.zeros(hidden, inter, dtype=BF16)
    lowers(gemv, "_gemv_kernel", lambda: gemv.gemv(gate_up, down, silu_mul_input=True))


def test_sampling_kernels_lower():
    """Sampling over qwen2.5's vocabulary (with and without a nucleus cutoff), the top-p search, the
    row masses and the penalties, as engine.sampler launches them."""
    rows, vocab = 8, 151936
    logits = torch.zeros(rows, vocab, dtype=torch.float32)
    key_lo, key_hi, position = (torch.zeros(rows, dtype=torch.int32) for _ in range(3))
    temperature = torch.ones(rows, dtype=torch.float32)
    cutoff = torch.zeros(rows, dtype=torch.float32)
    index = torch.arange(rows, dtype=torch.int32)
    for with_cutoff in (None, cutoff):
        launch = lambda c=with_cutoff: sampling.sample_rows(  # noqa: E731
            logits, temperature, key_lo, key_hi, position, c
        )
        lowers(sampling, "_sample_kernel", launch)
    # one row: its vocabulary cut into chunks (on CPU, a few a row), then the chunks' winners merged
    lowers(
        sampling, "_merge_chunks_kernel",
        lambda: sampling.sample_rows(logits[:1], temperature[:1], key_lo[:1], key_hi[:1], position[:1]),
    )  # fmt: skip
    lowers(
        sampling, "_top_p_pass_kernel",
        lambda: sampling.top_p_cutoffs(logits, index, temperature, temperature, temperature, index, cutoff),
    )  # fmt: skip
    lowers(
        sampling,
        "_row_mass_kernel",
        lambda: sampling.row_masses(logits, index, temperature, temperature, temperature),
    )
    counts = torch.zeros(rows, vocab, dtype=torch.int32)
    lowers(
        sampling, "_penalties_kernel",
        lambda: sampling.apply_penalties_in_place(logits, counts, index, index, temperature, temperature, temperature),
    )  # fmt: skip

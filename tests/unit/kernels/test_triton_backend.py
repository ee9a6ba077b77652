"""The Triton attention backend through the engine: the same greedy tokens as the torch reference.

On CPU the kernels run through Triton's interpreter (float32, the tiny model); on CUDA in bf16, where
near-ties may flip a token, so there the outputs must agree on most tokens and each must be a
near-argmax (tests/unit/engine/test_gpu.py holds the bf16 checks against transformers).

The fused rotary path (forward(..., rotary=(cos_sin, positions))) is checked on one hand-built step
against apply_rotary then the unfused forward: the same output, q, k and cache, bit for bit; and the
torch backend, which does not fuse rotary, refuses it. A step with prompt chunks plans its decodes
(engine.kernels.planned_decode_attention), as does one of many decodes, and a step of a few decodes
alone does not: all agree with the torch backend, and each forward pass plans afresh.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from test_rotary import make_cos_sin

from engine import LLM, SamplingParams
from engine.attention import AttentionMetadata, forward_context, get_backend
from engine.attention.triton_backend import PLANNED_MIN_DECODES
from engine.kernels import decode_attention, gemv, planned_decode_attention
from engine.kernels.rotary import apply_rotary

ON_CUDA = torch.cuda.is_available()


def _generate(model_dir, backend: str, prompts, **options):
    llm = LLM(
        str(model_dir),
        device="cuda" if ON_CUDA else "cpu",
        dtype="float32",
        attention_backend=backend,
        max_model_len=256,
        max_num_seqs=16,
        max_num_batched_tokens=64,  # long prompts are chunked: later chunks read their context from the cache
        block_size=8,
        enforce_eager=True,
        **options,
    )
    assert llm.engine.runner.backend.name == backend
    # 6 tokens: every decode step runs the same kernels, which the interpreter runs one program at a time
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in llm.generate(prompts, params)]


def test_triton_backend_generates_what_the_torch_backend_does(tiny_model_dir, monkeypatch):
    """Through the engine: fused rotary + K/V store, and the skinny matmul for every projection of the
    decode steps (at most 6 rows here), the MLP's activation fused into down_proj's input included."""
    config = json.loads((tiny_model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    qkv = hidden + 2 * config["num_key_value_heads"] * head_dim
    small = gemv.GemvConfig(
        block_n=64, block_k=128, split_k=2
    )  # few programs: the interpreter runs them in turn
    for shape in (
        (qkv, hidden, False),
        (hidden, hidden, False),
        (2 * inter, hidden, False),
        (hidden, inter, True),
    ):
        monkeypatch.setitem(gemv.TUNED, shape, small)
    rng = random.Random(1)
    prompts = [[rng.randrange(100, 30000) for _ in range(n)] for n in (1, 7, 8, 9, 30, 100)]
    reference = _generate(tiny_model_dir, "torch", prompts)
    calls = []
    monkeypatch.setattr(gemv, "_gemv_kernel", CountingKernel(gemv._gemv_kernel, calls))
    assert _generate(tiny_model_dir, "triton", prompts) == reference
    assert calls, "the decode steps never took the skinny matmul"


class CountingKernel:
    """A Triton kernel's stand-in that counts its launches (`kernel[grid](...)`) and runs the kernel."""

    def __init__(self, kernel, calls: list) -> None:
        self.kernel = kernel
        self.calls = calls

    def __getitem__(self, grid):
        self.calls.append(grid)
        return self.kernel[grid]


def test_unknown_backend_is_refused_by_name(tiny_model_dir):
    with pytest.raises(ValueError, match="unknown attention backend 'flash'"):
        LLM(str(tiny_model_dir), device="cpu", attention_backend="flash")


def make_step(context_lens: list[int], query_lens: list[int], padding_rows: int, dtype, device, seed=0):
    """A step over a random cache: sequence i computes its last query_lens[i] of context_lens[i]
    tokens (decodes first), each with its own shuffled block table; then padding_rows decode rows of
    seq_len 0 and slot -1, as a padded CUDA-graph batch carries. Returns (qkv, meta, positions, kv_cache,
    cos_sin) for 4 query heads and 2 KV heads of 16 in blocks of 4."""
    num_heads, num_kv_heads, head_dim, block_size, max_blocks = 4, 2, 16, 4, 8
    generator = torch.Generator().manual_seed(seed)
    num_seqs = len(context_lens) + padding_rows
    tables = torch.randperm(num_seqs * max_blocks, generator=generator).view(num_seqs, max_blocks)
    positions, slots = [], []
    for i, (context_len, query_len) in enumerate(zip(context_lens, query_lens, strict=True)):
        for position in range(context_len - query_len, context_len):
            positions.append(position)
            slots.append(int(tables[i, position // block_size]) * block_size + position % block_size)
    positions += [0] * padding_rows
    slots += [-1] * padding_rows
    query_lens = query_lens + [1] * padding_rows
    seq_lens = context_lens + [0] * padding_rows
    starts = [0]
    for query_len in query_lens:
        starts.append(starts[-1] + query_len)
    num_decodes = next((i for i, n in enumerate(query_lens) if n != 1), num_seqs)

    def as_int32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    meta = AttentionMetadata(
        slot_mapping=as_int32(slots),
        block_tables=tables.to(device=device, dtype=torch.int32),
        seq_lens=as_int32(seq_lens),
        query_start_loc=as_int32(starts),
        seq_lens_cpu=seq_lens,
        query_start_loc_cpu=starts,
        num_decodes=num_decodes,
        block_size=block_size,
        max_decode_len=max(seq_lens[:num_decodes], default=0),
        max_prefill_len=max(query_lens[num_decodes:], default=0),
    )
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(len(positions), width, generator=generator).to(device=device, dtype=dtype)
    cache_shape = (2, num_seqs * max_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = torch.randn(cache_shape, generator=generator).to(device=device, dtype=dtype)
    cos_sin = make_cos_sin(max_blocks * block_size, head_dim, 10000.0, device)
    return qkv, meta, torch.tensor(positions, device=device), kv_cache, cos_sin


def split_qkv(qkv: torch.Tensor):
    """q [num_tokens, 4, 16], k and v [num_tokens, 2, 16]: views of the qkv output, as the model's."""
    query, key, value = qkv.split([64, 32, 32], dim=-1)
    return query.view(-1, 4, 16), key.view(-1, 2, 16), value.view(-1, 2, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    "context_lens,query_lens,padding_rows",
    [
        ([6, 9, 8], [1, 1, 5], 0),  # two decodes and a chunk over a cached prefix, across blocks of 4
        ([5, 12], [1, 1], 2),  # decodes of a padded CUDA-graph batch
    ],
)
def test_fused_rotary_matches_rotary_then_forward(device, dtype, context_lens, query_lens, padding_rows):
    backend = get_backend("triton")
    assert backend.fuses_rotary
    qkv, meta, positions, kv_cache, cos_sin = make_step(context_lens, query_lens, padding_rows, dtype, device)
    backend.prepare(meta)
    unfused_qkv, unfused_cache = qkv.clone(), kv_cache.clone()
    query, key, value = split_qkv(unfused_qkv)
    apply_rotary(query, key, cos_sin, positions)
    expected = backend.forward(query, key, value, unfused_cache, meta, 0.25)

    query, key, value = split_qkv(qkv)
    out = backend.forward(query, key, value, kv_cache, meta, 0.25, rotary=(cos_sin, positions))

    assert torch.equal(out, expected)
    assert torch.equal(qkv, unfused_qkv)  # q and k rotated in place alike, v untouched
    assert torch.equal(kv_cache, unfused_cache)


def test_torch_backend_does_not_fuse_rotary(device):
    backend = get_backend("torch")
    assert not backend.fuses_rotary
    qkv, meta, positions, kv_cache, cos_sin = make_step([3], [1], 0, torch.float32, device)
    backend.prepare(meta)
    with pytest.raises(ValueError, match="does not fuse rotary"):
        backend.forward(*split_qkv(qkv), kv_cache, meta, 0.25, rotary=(cos_sin, positions))


@pytest.mark.parametrize(
    "context_lens,query_lens,padding_rows,planned",
    [
        ([30, 3, 9, 8], [1, 1, 1, 5], 0, True),  # decodes of 30 and 3 tokens beside a prompt chunk
        ([30, 3, 9], [1, 1, 1], 0, False),  # a few decodes alone: one split count for every row
        ([30, 3] * (PLANNED_MIN_DECODES // 2), [1] * PLANNED_MIN_DECODES, 0, True),  # many decodes alone
    ],
)
def test_mixed_steps_plan_their_decodes_and_decode_only_steps_do_not(
    device, monkeypatch, context_lens, query_lens, padding_rows, planned
):
    """A step that carries prompt chunks, or PLANNED_MIN_DECODES decodes or more, runs its decodes
    through the planned kernel (contexts cut by their share of the step); a few decodes alone through
    the one-split-count kernel, faster for one sequence. Either way the output is the torch backend's."""
    launches: dict[str, list] = {"planned": [], "one count": []}
    monkeypatch.setattr(
        planned_decode_attention,
        "_decode_split_kernel",
        CountingKernel(planned_decode_attention._decode_split_kernel, launches["planned"]),
    )
    monkeypatch.setattr(
        decode_attention,
        "_decode_split_kernel",
        CountingKernel(decode_attention._decode_split_kernel, launches["one count"]),
    )
    outputs = []
    for name in ("torch", "triton"):
        backend = get_backend(name)
        qkv, meta, _, kv_cache, _ = make_step(context_lens, query_lens, padding_rows, torch.float32, device)
        backend.prepare(meta)
        with forward_context(meta):
            outputs.append(backend.forward(*split_qkv(qkv), kv_cache, meta, 0.25))
    torch.testing.assert_close(outputs[1], outputs[0], atol=2e-5, rtol=2e-5)
    assert (meta.decode_plan is not None) == planned
    assert (len(launches["planned"]), len(launches["one count"])) == ((1, 0) if planned else (0, 1))


def test_each_forward_pass_plans_its_decodes_afresh(device):
    """A mixed step's work items are planned on the device by a pass's first layer and shared by the
    rest. A CUDA graph is captured with the metadata of its warm-up pass and replayed over new lengths:
    a second pass over the same metadata, its lengths changed in place, must attend over the new ones,
    not reuse the first pass's plan."""
    backend = get_backend("triton")
    qkv, meta, _, kv_cache, _ = make_step([30, 9, 8], [1, 1, 5], 0, torch.float32, device)
    with forward_context(meta):
        backend.forward(*split_qkv(qkv), kv_cache.clone(), meta, 0.25)
    first_plan = meta.decode_plan
    assert first_plan is not None
    qkv2, meta2, _, kv_cache2, _ = make_step([3, 9, 8], [1, 1, 5], 0, torch.float32, device)
    for name in ("slot_mapping", "seq_lens", "block_tables", "query_start_loc"):
        getattr(meta, name).copy_(getattr(meta2, name))  # as a graph's step buffers are refilled
    with forward_context(meta):
        replayed = backend.forward(*split_qkv(qkv2.clone()), kv_cache2.clone(), meta, 0.25)
    assert meta.decode_plan is not first_plan
    with forward_context(meta2):
        expected = backend.forward(*split_qkv(qkv2.clone()), kv_cache2.clone(), meta2, 0.25)
    assert torch.equal(replayed, expected)

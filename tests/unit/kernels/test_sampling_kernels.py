"""The sampling kernels against their torch reference (engine/kernels/sampling_reference.py).

sample_rows: token ids must equal the reference's exactly. Both compute the same integer hash, the
same float32 uniforms and the same Gumbel transform; only the last bits of log (and an FMA the compiler
may fuse) can differ, which changes a draw only when two candidates' scores are within float32
rounding of each other. The interpreter matches exactly; on CUDA a differing token must be such a
near-tie under the reference's own scores (NEAR_TIE), and there must be almost none.

top_p_cutoffs: the k-ary search must find the reference's cutoff (a full sort), exactly, on rows
where no candidate's cumulative mass lies within float32 summation error of top_p: random rows, and
rows built so that the cutoff falls on ties, on lower or top itself, on neighbouring float32 values,
across zero, at top_p 1 and tiny top_p, with -inf logits, searched 2-, 4- and 16-ary, and with rows
split over many programs a pass (blocks made small so that tiny rows span many chunks).

CPU (interpreter): tiny shapes, float32 logits (the sampler always gets float32). CUDA (gpu): the
vocabulary of qwen2.5 (151,936) at 1, 64 and 256 rows, replay from a CUDA graph, and no kernel
compiled at a new batch size after a warm-up at one row and at many.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import sampling
from engine.kernels.sampling import apply_penalties_in_place, row_masses, sample_rows, top_p_cutoffs
from engine.kernels.sampling_reference import (
    PROMPT_FLAG,
    apply_penalties,
    gumbel_noise,
    row_masses_reference,
    row_states,
    sample_reference,
    top_p_cutoffs_reference,
)

ON_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not ON_CUDA, reason="needs a CUDA device")
NEAR_TIE = 1e-4  # score gap (logits) under which float32 rounding may decide the draw


def make_rows(rows: int, vocab: int, device: torch.device, seed: int = 0, scale: float = 2.0):
    """Logits, temperatures (some 0: argmax rows), and the parameter columns of a [rows, 11] table,
    as the sampler keeps them (strided views sharing one stride)."""
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * scale).to(device)
    table = torch.zeros(rows, 11, dtype=torch.int32)
    temperature = torch.rand(rows, generator=generator) * 1.5 + 0.2
    temperature[::4] = 0.0
    table[:, 0] = temperature.view(torch.int32)
    table[:, 7:9] = torch.randint(-(2**31), 2**31 - 1, (rows, 2), dtype=torch.int32, generator=generator)
    table[:, 10] = torch.randint(0, 5000, (rows,), dtype=torch.int32, generator=generator)
    table = table.to(device)
    return logits, table[:, 0].view(torch.float32), table[:, 7], table[:, 8], table[:, 10]


def assert_same_tokens(
    actual: torch.Tensor, logits, temperature, cutoff, key_lo, key_hi, position, exact: bool
):
    expected = sample_reference(logits, temperature, cutoff, key_lo, key_hi, position)
    differ = (actual != expected).nonzero()[:, 0]
    if exact or len(differ) == 0:
        assert torch.equal(actual, expected)
        return
    scores = logits + temperature[:, None] * gumbel_noise(
        row_states(key_lo, key_hi, position), logits.shape[1]
    )
    if cutoff is not None:
        scores = scores.masked_fill(logits < cutoff[:, None], float("-inf"))
    for row in differ.tolist():
        gap = scores[row, expected[row]] - scores[row, actual[row]]
        assert 0 <= gap.item() < NEAR_TIE, (
            f"row {row}: token {actual[row]} scores {gap.item()} below the best"
        )
    assert len(differ) <= max(1, len(actual) // 100)


@pytest.mark.parametrize("rows,vocab", [(1, 1), (4, 5), (9, 100), (3, 1000), (2, 5000)])
def test_sample_rows_matches_reference(device, rows, vocab):
    logits, temperature, key_lo, key_hi, position = make_rows(rows, vocab, device, seed=vocab)
    tokens = sample_rows(logits, temperature, key_lo, key_hi, position)
    assert tokens.dtype == torch.int64 and tokens.shape == (rows,)
    assert_same_tokens(tokens, logits, temperature, None, key_lo, key_hi, position, exact=not ON_CUDA)
    argmax_rows = temperature == 0
    assert torch.equal(tokens[argmax_rows], logits[argmax_rows].argmax(-1))


def test_sample_rows_with_cutoffs_never_draws_below_them(device):
    rows, vocab = 16, 300
    logits, temperature, key_lo, key_hi, position = make_rows(rows, vocab, device, seed=3)
    temperature.fill_(5.0)  # hot: without the cutoff most draws would land below it
    cutoff = logits.sort(dim=-1, descending=True).values[:, torch.arange(rows) % 7].diagonal().contiguous()
    cutoff[3] = float("-inf")
    tokens = sample_rows(logits, temperature, key_lo, key_hi, position, cutoff=cutoff)
    assert (logits.gather(1, tokens[:, None])[:, 0] >= cutoff).all()
    assert_same_tokens(tokens, logits, temperature, cutoff, key_lo, key_hi, position, exact=not ON_CUDA)


@pytest.mark.parametrize("vocab", [40, 3000])  # one block; several blocks split over programs
def test_argmax_rows_break_ties_as_torch(device, vocab):
    logits = torch.zeros(4, vocab, device=device)
    logits[0, [5, 9, 30, vocab - 1]] = 1.0  # ties within a block and, at 3000, across chunks
    logits[1] = float("-inf")
    logits[2, vocab - 1] = 2.0
    logits[3, : vocab // 2] = float("-inf")  # a chunk of -inf before the maximum's
    logits[3, vocab - 2] = 0.5
    zeros = torch.zeros(4, dtype=torch.int32, device=device)
    tokens = sample_rows(logits, torch.zeros(4, device=device), zeros, zeros, zeros)
    assert tokens.tolist() == logits.argmax(-1).tolist() == [5, 0, vocab - 1, vocab - 2]
    cutoff = torch.full((4,), float("inf"), device=device)  # every token cut: the first, as torch
    tokens = sample_rows(logits, torch.ones(4, device=device), zeros, zeros, zeros, cutoff=cutoff)
    assert tokens.tolist() == [0, 0, 0, 0]


def test_same_key_and_position_same_token_any_row(device):
    """A draw depends on (key, position, logits) only: not on its row or its neighbours."""
    rows, vocab = 12, 64
    logits, temperature, key_lo, key_hi, position = make_rows(rows, vocab, device, seed=5)
    temperature.fill_(1.0)
    tokens = sample_rows(logits, temperature, key_lo, key_hi, position)
    order = torch.arange(rows - 1, -1, -1, device=device)
    shuffled = sample_rows(
        logits[order].contiguous(),
        temperature[order].contiguous(),
        key_lo[order].contiguous(),
        key_hi[order].contiguous(),
        position[order].contiguous(),
    )
    assert torch.equal(shuffled, tokens[order])


def _nucleus_case(rows: int, vocab: int, device: torch.device, seed: int):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(device)
    temperature = (torch.rand(rows, generator=generator) + 0.5).to(device)
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.2, 0.75, 0.97, 1e-6, 0.6][:rows], device=device)
    lower = torch.full((rows,), float("-inf"), device=device)
    lower[1::3] = logits[1::3].amax(-1) - 2.5  # min-p's cutoff on some rows
    return logits, temperature, top_p, lower


@pytest.mark.parametrize("vocab", [1, 7, 300, 5000])
def test_top_p_search_matches_the_sort(device, vocab):
    rows = 8
    logits, temperature, top_p, lower = _nucleus_case(rows, vocab, device, seed=vocab)
    expected = top_p_cutoffs_reference(logits, temperature, top_p, lower)
    needs = torch.ones(rows, dtype=torch.int32, device=device)
    needs[2] = 0  # skipped: left as it was
    cutoff = torch.full((rows,), 123.0, device=device)
    index = torch.arange(rows, dtype=torch.int32, device=device)
    top_p_cutoffs(logits, index, temperature, top_p, lower, needs, cutoff)
    assert cutoff[2].item() == 123.0
    keep = needs.bool()
    assert torch.equal(cutoff[keep], expected[keep])


def test_top_p_search_reads_the_rows_it_is_given(device):
    """Entries read their logits row through `rows` (a row twice); the rows' largest logits given
    (as the sampler has them) or computed inside give the same cutoffs."""
    logits, temperature, top_p, lower = _nucleus_case(8, 64, device, seed=11)
    rows = torch.tensor([5, 0, 5], dtype=torch.int32, device=device)
    pick = rows.long()
    expected = top_p_cutoffs_reference(logits[pick], temperature[pick], top_p[pick], lower[pick])
    for top in (None, logits[pick].amax(-1)):
        cutoff = torch.empty(3, device=device)
        top_p_cutoffs(
            logits,
            rows,
            temperature[pick].contiguous(),
            top_p[pick].contiguous(),
            lower[pick].contiguous(),
            torch.ones(3, dtype=torch.int32, device=device),
            cutoff,
            top=top,
        )
        assert torch.equal(cutoff, expected)


ULP = 2.0**-23  # float32 spacing just above 1.0
TIES = [(3.0, 1), (2.0, 5), (1.0, 10), (0.0, 21)]  # weights at T=1: 20.1, 36.9, 27.2, 21 (of 105.2)
SIGNS = [(1.5, 1), (0.25, 2), (0.0, 2), (-0.0, 2), (-0.3, 4), (-1.2, 6), (-4.0, 20)]
STEPS = [(1.0 + k * ULP, 1) for k in range(10)] + [(-5.0, 27)]  # ten neighbouring float32 values
INF = float("inf")
# (id, (value, count) of the row's 37 designed logits, temperature, top_p, lower, the cutoff). Each
# top_p lies clear of every cumulative mass, so the sort and the search must agree exactly.
NUCLEUS_EDGES = [
    ("ties-straddle-top-p", TIES, 1.0, 0.3, -INF, 2.0),  # two of the five 2.0s reach it; all 5 kept
    ("ties-below-a-tie-group", TIES, 1.0, 0.6, -INF, 1.0),
    ("top-itself", TIES, 1.0, 0.1, -INF, 3.0),
    ("tiny-top-p", TIES, 1.0, 1e-6, -INF, 3.0),
    ("top-p-one", TIES, 1.0, 1.0, -INF, 0.0),
    ("lower-itself", TIES, 1.0, 0.9, 1.0, 1.0),
    ("lower-between-logits", TIES, 1.0, 1.0, 0.5, 1.0),
    ("lower-is-top", TIES, 1.0, 0.5, 3.0, 3.0),
    ("cold", TIES, 0.5, 0.6, -INF, 2.0),
    ("hot", TIES, 2.0, 0.9, -INF, 0.0),
    ("neg-inf-logits", [(3.0, 1), (2.0, 5), (1.0, 10), (0.0, 11), (-INF, 10)], 1.0, 1.0, -INF, 0.0),
    ("signs-zero", SIGNS, 1.0, 0.55, -INF, 0.0),
    ("signs-negative-cutoff", SIGNS, 1.0, 0.8, -INF, -0.3),
    ("signs-near-one", SIGNS, 1.0, 0.95, -INF, -1.2),
    ("signs-top-p-one", SIGNS, 1.0, 1.0, -INF, -4.0),
    ("signs-lower-itself", SIGNS, 1.0, 0.999, -1.2, -1.2),
    ("equal-negative", [(-2.5, 37)], 0.7, 0.5, -INF, -2.5),
    ("equal-top-p-one-lower-itself", [(-2.5, 37)], 1.0, 1.0, -2.5, -2.5),
    ("equal-positive-tiny-top-p", [(7.0, 37)], 1.0, 1e-6, -INF, 7.0),
    ("neighbours-within-lower", STEPS, 1.0, 0.55, 1.0, 1.0 + 4 * ULP),  # 10 keys: one pass settles
    ("neighbours", STEPS, 1.0, 0.55, -INF, 1.0 + 4 * ULP),
    (
        "twenty-neighbours",
        [(1.0 + k * ULP, 1) for k in range(20)] + [(-5.0, 17)],
        1.0,
        0.55,
        1.0,
        1.0 + 9 * ULP,
    ),
    (
        "negative-neighbours",
        [(-1.0 - k * ULP, 1) for k in range(10)] + [(-5.0, 27)],
        1.0,
        0.55,
        -1.0 - 9 * ULP,
        -1.0 - 5 * ULP,
    ),
]


def _edge_rows(cases, vocab: int, device: torch.device, seed: int):
    """The cases' designed logits scattered among -inf in rows of `vocab`, and their temperature,
    top_p, lower and expected cutoff as [len(cases)] float32."""
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _, values, *_ in cases:
        designed = torch.tensor([value for value, count in values for _ in range(count)])
        assert len(designed) == 37
        pad = designed[0].item() if len(values) == 1 else -INF  # an all-equal row stays all equal
        row = torch.full((vocab,), pad)
        row[torch.randperm(vocab, generator=generator)[:37]] = designed
        rows.append(row)
    columns = (
        torch.tensor([case[i] for case in cases], dtype=torch.float32, device=device) for i in range(2, 6)
    )
    return (torch.stack(rows).to(device), *columns)


# The designed logits alone (37), and scattered among -inf (3000); K = 2 (a bisection: 33 launches,
# the interpreter's slowest case) on the short row only.
@pytest.mark.parametrize(("vocab", "thresholds"), [(37, 2), (37, 4), (37, 16), (3000, 4), (3000, 16)])
def test_top_p_search_edge_cases(device, monkeypatch, vocab, thresholds):
    """The sort and the K-ary search agree exactly, with the cutoff worked out by hand, where an
    off-by-one in the search would show: ties at the cutoff, the cutoff at lower or at top itself,
    neighbouring float32 values (the last passes weigh fewer than K keys), mixed signs."""
    monkeypatch.setattr(sampling, "BISECT_THRESHOLDS", thresholds)
    logits, temperature, top_p, lower, expected = _edge_rows(NUCLEUS_EDGES, vocab, device, seed=vocab)
    n = len(NUCLEUS_EDGES)
    cutoff = torch.full((n,), 123.0, device=device)
    index = torch.arange(n, dtype=torch.int32, device=device)
    top_p_cutoffs(logits, index, temperature, top_p, lower, torch.ones_like(index), cutoff)
    reference = top_p_cutoffs_reference(logits, temperature, top_p, lower)
    ids = [case[0] for case in NUCLEUS_EDGES]
    wanted = dict(zip(ids, expected.tolist(), strict=True))
    assert dict(zip(ids, reference.tolist(), strict=True)) == wanted
    assert dict(zip(ids, cutoff.tolist(), strict=True)) == wanted
    # The largest key of the mass: +0.0, above -0.0 in the float32 order, though they compare equal.
    assert torch.signbit(cutoff[ids.index("signs-zero")]).item() is False


@pytest.mark.parametrize(
    "cases,vocab,programs",
    [
        ([13], 300, 64),  # one row in 19 chunks of one block
        ([0, 7, 12, 13, 20], 300, 48),  # 5 rows: 9 chunks wanted, 7 of 3 blocks, the last of 1
        ([1, 4, 6, 10, 15, 16, 21], 1000, 48),  # 7 rows: 6 chunks of 11 blocks, the last of 8
    ],
    ids=["one-row", "five-rows", "seven-rows"],
)
def test_top_p_search_split_over_chunks(device, monkeypatch, cases, vocab, programs):
    """Rows split over many programs a pass (blocks of 16 logits, many programs wanted): the chunks'
    masses summed in every program give the cutoffs worked out by hand. Unflagged rows keep their
    value; the others do not depend on them."""
    monkeypatch.setattr(sampling, "BISECT_BLOCK", 16)
    monkeypatch.setattr(sampling, "_programs_wanted", lambda device: programs)
    picked = [NUCLEUS_EDGES[i] for i in cases]
    logits, temperature, top_p, lower, expected = _edge_rows(picked, vocab, device, seed=len(cases))
    n = len(picked)
    index = torch.arange(n, dtype=torch.int32, device=device)
    needs = torch.ones_like(index)
    needs[1::3] = 0  # the 2nd and 5th rows of five and seven: skipped
    cutoff = torch.full((n,), 123.0, device=device)
    top_p_cutoffs(logits, index, temperature, top_p, lower, needs, cutoff)
    assert torch.equal(cutoff, torch.where(needs.bool(), expected, 123.0))


@pytest.mark.parametrize("vocab", [1, 300, 5000])
def test_row_masses_match_reference(device, vocab):
    logits, temperature, _, lower = _nucleus_case(8, vocab, device, seed=vocab + 1)
    rows = torch.tensor([3, 0, 7, 7], dtype=torch.int32, device=device)
    pick = rows.long()
    top = logits[pick].amax(-1)
    masses = row_masses(logits, rows, top, temperature[pick].contiguous(), lower[pick].contiguous())
    expected = row_masses_reference(logits[pick], top, temperature[pick], lower[pick])
    torch.testing.assert_close(masses, expected, rtol=1e-5, atol=0)


@pytest.mark.parametrize("rows,vocab", [(3, 7), (5, 300), (2, 5000)])
def test_penalties_in_place_match_reference(device, rows, vocab):
    generator = torch.Generator().manual_seed(vocab)
    logits = (torch.randn(rows, vocab, generator=generator) * 3).to(device)
    counts = torch.randint(0, 3, (4, vocab), dtype=torch.int32, generator=generator)
    counts[torch.rand(4, vocab, generator=generator) < 0.2] |= PROMPT_FLAG
    counts = counts.to(device)
    table = torch.zeros(rows, 11, device=device)  # penalties as strided columns of a table
    table[:, 4] = torch.linspace(-2, 2, rows)
    table[:, 5] = torch.linspace(1, -1, rows)
    table[:, 6] = torch.linspace(0.5, 2.5, rows)
    presence, frequency, repetition = table[:, 4], table[:, 5], table[:, 6]
    batch_rows = torch.tensor([rows - 1, 0], dtype=torch.int32, device=device)  # a row left alone
    count_rows = torch.tensor([2, 3], dtype=torch.int32, device=device)
    pick, pool = batch_rows.long(), count_rows.long()
    expected = logits.clone()
    expected[pick] = apply_penalties(
        logits[pick], counts[pool], presence[pick], frequency[pick], repetition[pick]
    )
    apply_penalties_in_place(logits, counts, batch_rows, count_rows, presence, frequency, repetition)
    if ON_CUDA:  # the compiler may fuse a multiply and a subtract: 1 ulp
        torch.testing.assert_close(logits, expected, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(logits, expected)


BAD_CALLS = [  # (what the message names, call given logits [4, 16] float32 and int32 zeros [4])
    ("logits must be", lambda x, z, t: sample_rows(x[0], t, z, z, z)),
    ("logits has dtype", lambda x, z, t: sample_rows(x.half(), t, z, z, z)),
    ("temperature has shape", lambda x, z, t: sample_rows(x, t[:3], z, z, z)),
    ("key_lo has dtype", lambda x, z, t: sample_rows(x, t, z.long(), z, z)),
    ("cutoff has shape", lambda x, z, t: sample_rows(x, t, z, z, z, cutoff=t[:2])),
    ("needs has dtype", lambda x, z, t: top_p_cutoffs(x, z, t, t, t, z.float(), t.clone())),
]


@pytest.mark.parametrize("message,call", BAD_CALLS, ids=[message for message, _ in BAD_CALLS])
def test_bad_inputs_raise_value_error_naming_the_problem(device, message, call):
    logits = torch.randn(4, 16, device=device)
    with pytest.raises(ValueError, match=message):
        call(logits, torch.zeros(4, dtype=torch.int32, device=device), torch.ones(4, device=device))


# -- CUDA at the real vocabulary ---------------------------------------------------------------------
VOCAB = 151_936


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 64, 256])
def test_gpu_real_vocabulary_matches_reference(rows):
    device = torch.device("cuda")
    logits, temperature, key_lo, key_hi, position = make_rows(rows, VOCAB, device, seed=rows)
    tokens = sample_rows(logits, temperature, key_lo, key_hi, position)
    assert_same_tokens(tokens, logits, temperature, None, key_lo, key_hi, position, exact=False)
    cutoff = logits.topk(50, dim=-1).values[:, -1].contiguous()
    tokens = sample_rows(logits, temperature, key_lo, key_hi, position, cutoff=cutoff)
    assert (logits.gather(1, tokens[:, None])[:, 0] >= cutoff).all()
    assert_same_tokens(tokens, logits, temperature, cutoff, key_lo, key_hi, position, exact=False)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("rows", [1, 64])
def test_gpu_top_p_search_at_the_real_vocabulary(rows):
    device = torch.device("cuda")
    generator = torch.Generator().manual_seed(rows)
    logits = (torch.randn(rows, VOCAB, generator=generator) * 4).to(device)
    temperature = torch.ones(rows, device=device)
    top_p = torch.full((rows,), 0.9, device=device)
    lower = torch.full((rows,), float("-inf"), device=device)
    expected = top_p_cutoffs_reference(logits, temperature, top_p, lower)
    cutoff = torch.empty(rows, device=device)
    index = torch.arange(rows, dtype=torch.int32, device=device)
    top_p_cutoffs(logits, index, temperature, top_p, lower, torch.ones_like(index), cutoff)
    # The kept sets may differ only by tokens whose cumulative mass sits within float32 summation
    # error (1e-5 of the row's mass) of top_p.
    kept_kernel = (logits >= cutoff[:, None]).sum(-1)
    kept_reference = (logits >= expected[:, None]).sum(-1)
    assert ((kept_kernel - kept_reference).abs() <= 0.0002 * kept_reference + 2).all()


@pytest.mark.gpu
@requires_cuda
def test_gpu_cuda_graph_replay_reads_new_inputs():
    device = torch.device("cuda")
    logits, temperature, key_lo, key_hi, position = make_rows(64, VOCAB, device)
    out = torch.empty(64, dtype=torch.int64, device=device)
    sample_rows(logits, temperature, key_lo, key_hi, position, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sample_rows(logits, temperature, key_lo, key_hi, position, out=out)
    new_logits, _, new_lo, _, new_position = make_rows(64, VOCAB, device, seed=9)
    logits.copy_(new_logits)
    key_lo.copy_(new_lo)
    position.copy_(new_position)
    graph.replay()
    torch.cuda.synchronize()
    assert_same_tokens(out, logits, temperature, None, key_lo, key_hi, position, exact=False)


@pytest.mark.gpu
@requires_cuda
def test_gpu_no_new_variant_at_a_new_batch_size():
    """After each function ran at one row and at many, no other batch size compiles a kernel: the
    chunk counts that follow the row count are unspecialized, and no constexpr depends on them."""
    import triton

    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        pytest.skip(f"triton {triton.__version__} has no jit_post_compile_hook")
    device = torch.device("cuda")

    def run_all(rows: int) -> None:
        logits, temperature, key_lo, key_hi, position = make_rows(rows, VOCAB, device, seed=rows)
        index = torch.arange(rows, dtype=torch.int32, device=device)
        ones = torch.ones(rows, device=device)
        cutoff = logits.topk(50, dim=-1).values[:, -1].contiguous()
        sample_rows(logits, temperature, key_lo, key_hi, position)
        sample_rows(logits, temperature, key_lo, key_hi, position, cutoff=cutoff)
        lower = torch.full((rows,), float("-inf"), device=device)
        top_p_cutoffs(logits, index, ones, ones * 0.9, lower, torch.ones_like(index), cutoff)
        row_masses(logits, index, logits.amax(-1), ones, lower)
        counts = torch.ones(rows, VOCAB, dtype=torch.int32, device=device)
        penalty = torch.ones(rows, 3, device=device)  # columns of one table, as the sampler's
        apply_penalties_in_place(logits, counts, index, index, penalty[:, 0], penalty[:, 1], penalty[:, 2])

    for rows in (1, 256):  # the warm-up
        run_all(rows)
    compiled: list[str] = []
    previous = runtime.jit_post_compile_hook

    def hook(**kwargs):
        compiled.append(kwargs["repr"])

    runtime.jit_post_compile_hook = hook
    try:
        for rows in (2, 3, 17, 64, 100, 300, 600):  # 300 and more: one chunk a row on the H200
            run_all(rows)
    finally:
        runtime.jit_post_compile_hook = previous
    assert compiled == []

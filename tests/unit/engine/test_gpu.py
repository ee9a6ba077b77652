"""CUDA: bf16 generation agrees with transformers (up to bf16 near-ties), and the 1.5B preset runs.

Skipped without CUDA. Near-ties: in bf16 two logits can round to within a hair of each other, and the
two implementations may then pick different tokens. So each token the engine picked is checked
teacher-forced: under transformers, given the same prefix, its logit must be within TIE_TOLERANCE of
the best one; and most tokens must match transformers' own greedy choice exactly.
"""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams, kernel_compiles
from engine.runner import PendingTokens, tokens_ready_event
from engine.synthetic import write_checkpoint

pytestmark = pytest.mark.gpu

TIE_TOLERANCE = 0.1  # logits; bf16 spacing near |logit| ~ 4 is 0.03


def test_bf16_matches_transformers_up_to_ties(tiny_model_dir):
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in (1, 7, 16, 33, 200, 1000)]
    llm = LLM(
        str(tiny_model_dir), device="cuda", dtype="bfloat16", max_model_len=2048, max_num_batched_tokens=512
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).cuda()
    exact = total = 0
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = torch.tensor([prompt + out.token_ids], device="cuda")
        with torch.no_grad():
            logits = (
                hf(ids).logits[0, len(prompt) - 1 : -1].float()
            )  # [32, vocab]: the logits each token was picked from
        chosen = logits.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
        gap = logits.max(dim=1).values - chosen
        assert (gap <= TIE_TOLERANCE).all(), (
            f"a token was not a near-argmax under transformers: gaps {gap.tolist()}"
        )
        exact += int((gap == 0).sum())
        total += len(out.token_ids)
    print(
        f"bf16 tiny: {exact}/{total} tokens are transformers' exact argmax, the rest within {TIE_TOLERANCE}"
    )
    assert exact / total >= 0.9


def test_qwen25_15b_preset_generates_a_batch(tmp_path_factory):
    model_dir = write_checkpoint("qwen2.5-1.5b", tmp_path_factory.mktemp("qwen"), dtype="bfloat16")
    llm = LLM(str(model_dir), device="cuda", max_model_len=4352)
    assert llm.engine.dtype == torch.bfloat16
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.choice([16, 256, 1024]))] for _ in range(32)]
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    assert all(len(o.token_ids) == 64 for o in outputs)
    assert all(isinstance(o.text, str) for o in outputs)
    print(
        f"qwen2.5-1.5b bf16: 32 requests x 64 tokens in {elapsed:.2f} s = {32 * 64 / elapsed:.0f} output tok/s; {llm.engine.cache_config.num_blocks} KV blocks"
    )


def test_decode_graphs_replay_what_eager_steps_compute(tiny_model_dir):
    """float32, so graph replay (padded batches, captured kernels) and eager steps must pick the same tokens."""
    rng = random.Random(2)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randrange(1, 300))] for _ in range(37)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    results = {}
    for eager in (False, True):
        llm = LLM(
            str(tiny_model_dir), device="cuda", dtype="float32", max_model_len=1024, enforce_eager=eager
        )
        assert (llm.engine.runner.graphs is None) == eager
        results[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        del llm
        gc.collect()  # the engine holds reference cycles: free its KV cache before the next one sizes its own
        torch.cuda.empty_cache()
    assert results[False] == results[True]


def test_mixed_step_graphs_replay_what_eager_steps_compute(tiny_model_dir):
    """float32: prompts chunked beside running decodes (a 256-token step budget), so most steps carry
    prompt chunks and replay the mixed-step graphs, padded; the same tokens as every step eager."""
    rng = random.Random(4)
    prompts = [[rng.randrange(1000, 30000) for _ in range(rng.randrange(1, 700))] for _ in range(24)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    results, mixed_steps = {}, []
    for eager in (False, True):
        llm = LLM(
            str(tiny_model_dir),
            device="cuda",
            dtype="float32",
            max_model_len=1024,
            max_num_batched_tokens=256,
            max_num_seqs=16,
            enforce_eager=eager,
        )
        runner = llm.engine.runner
        assert (runner.mixed_graphs is None) == eager
        if not eager:
            assert runner.mixed_graphs.sizes[-1] == 256
            assert llm.engine.config_dict()["mixed_graph_max_tokens"] == 256
            runner.prepare = _noting(runner.prepare, mixed_steps)
        results[eager] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.stats().kv_blocks_used == 0
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert results[False] == results[True]
    replayed = [(chunks, size) for chunks, size in mixed_steps if size]
    assert sum(chunks > 0 for chunks, _ in replayed) >= 10, mixed_steps


def test_serving_compiles_no_kernel_after_start_up(tiny_model_dir):
    """A Triton kernel variant first met while serving compiles on the engine's loop and stalls every
    request (on a fresh H100 the decode plan kernel once compiled ~10 times in closed loops, before its
    counts were unspecialised). After start-up, steps of every kind (decodes alone from 1 to 48 rows,
    mixed steps replayed and eager, past the mixed graphs' largest size; each sampling path) must find
    every variant compiled (EngineStats.kernel_compiles, engine.kernel_compiles)."""
    llm = LLM(
        str(tiny_model_dir),
        device="cuda",
        dtype="bfloat16",
        max_model_len=2048,
        max_num_batched_tokens=1024,
        max_num_seqs=48,
        mixed_graph_max_tokens=256,
    )
    rng = random.Random(5)
    lengths = [rng.choice((1, 3, 17, 100, 300, 700, 1500)) for _ in range(96)]
    prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in lengths]
    # Greedy and sampled rows side by side; nucleus, top-k and min-p, the penalties.
    modes = (
        {"temperature": 0.0},
        {"temperature": 1.0},
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.7, "top_k": 20, "min_p": 0.05},
        {"temperature": 1.0, "presence_penalty": 0.4, "repetition_penalty": 1.2},
    )
    params = [
        SamplingParams(max_tokens=rng.randrange(1, 80), ignore_eos=True, **rng.choice(modes)) for _ in prompts
    ]
    outputs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outputs] == [p.max_tokens for p in params]
    # The engine counts through Triton's compile hook, which sees every in-process cache miss.
    compiles = llm.engine.stats().kernel_compiles
    assert compiles == 0, (
        f"compiled while serving: {kernel_compiles.kernels(kernel_compiles.compiled() - compiles)}"
    )


def _timed(call) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of call()."""
    wall, cpu = time.perf_counter(), time.process_time()
    call()
    return time.perf_counter() - wall, time.process_time() - cpu


def _queue_a_second_of_device_work() -> None:
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # clock cycles: ~1 s on an H100 or H200


def test_the_wait_for_a_steps_tokens_sleeps_rather_than_spins():
    """With async scheduling a busy server's engine core spends most of its time waiting for the step
    before the one it just launched. CUDA's default event spins a core for the whole wait, which `bench
    host-cost` counts against the server; the event a step records is a blocking one."""
    host = torch.zeros(4, dtype=torch.int64).pin_memory()

    def wait() -> None:
        done = tokens_ready_event()
        done.record()
        assert PendingTokens(host, done, [3, 2, 1, 0]).result() == [0, 0, 0, 0]

    _queue_a_second_of_device_work()
    wall, cpu = _timed(wait)
    assert wall > 0.3, f"the wait did not wait for the device ({wall:.3f} s)"
    assert cpu < 0.25 * wall, f"{cpu:.3f} CPU-seconds in a {wall:.3f} s wait: it spins"


def test_a_warm_step_queues_behind_the_device_and_its_successor_sleeps_waiting(tiny_model_dir):
    """A step of shapes already met launches without waiting for the device (the overlap async
    scheduling is for: nothing in schedule, prepare or launch synchronises), and the next step's wait
    for its tokens sleeps. The first step of a new shape may wait (CUDA loads a kernel's module on
    its first launch), so the same request runs once before."""
    llm = LLM(str(tiny_model_dir), device="cuda", dtype="bfloat16", max_model_len=256)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7, 8]], params)
    engine.add_request("a", [5, 6, 7, 8], params)
    first: list = []
    _queue_a_second_of_device_work()
    wall, _ = _timed(lambda: first.extend(engine.step()))  # the first step: queued behind that second
    assert first == [] and wall < 0.3, f"the first step waited {wall:.3f} s for the device"
    wall, cpu = _timed(engine.step)  # queues the second step, then waits for the first one's tokens
    assert wall > 0.3, f"the second step did not wait for the first one's tokens ({wall:.3f} s)"
    assert cpu < 0.25 * wall, f"{cpu:.3f} CPU-seconds in a {wall:.3f} s wait: it spins"
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert [(o.request_id, len(o.token_ids)) for o in finished] == [("a", 4)]


def _noting(prepare, steps: list):
    """ModelRunner.prepare that notes each step's (prompt chunks, mixed graph size or 0)."""

    def noted(*args):
        batch = prepare(*args)
        steps.append((batch.metadata.num_seqs - batch.metadata.num_decodes, batch.mixed_size))
        return batch

    return noted


def test_triton_is_the_default_backend_on_cuda(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), device="cuda", max_model_len=512)
    assert llm.engine.runner.backend.name == "triton"
    assert llm.engine.config_dict()["cuda_graphs"] is True

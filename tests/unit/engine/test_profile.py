"""`python -m engine.profile` runs on CPU and reports, per batch, the step time, the bytes a step must
move, the host's time per phase, and (from the profiler's device events) the GPU-busy fraction and
kernel launches per step."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from torch.autograd import DeviceType

import engine.profile as profile_module
from engine import EngineArgs, LLMEngine
from engine.profile import (
    DEFAULT_BATCHES,
    batch_contexts,
    bytes_per_decode_step,
    device_figures,
    device_idle,
    main,
    steady_step_seconds,
)


def test_bytes_per_decode_step_counts_weights_once_and_each_sequence_kv(tiny_model_dir):
    engine = LLMEngine(
        EngineArgs(model=str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=512)
    )
    weights = sum(p.numel() for p in engine.runner.model.parameters()) * 4  # float32, tied head counted once
    kv_per_token = 2 * 4 * 2 * 32 * 4  # K and V, 4 layers, 2 KV heads of 32, float32
    assert bytes_per_decode_step(engine, [100] * 3) == weights + 3 * 100 * kv_per_token
    assert bytes_per_decode_step(engine, [16, 400]) == weights + 416 * kv_per_token


def event(name: str, device: DeviceType, microseconds: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(
        name=name, device_type=device, time_range=SimpleNamespace(elapsed_us=lambda: microseconds)
    )


def test_device_figures_add_up_device_time_and_count_launches_per_step():
    events = [
        event("aten::mm", DeviceType.CPU),
        event("cudaLaunchKernel", DeviceType.CPU),
        event("cuLaunchKernel", DeviceType.CPU),  # a Triton kernel
        event("cudaGraphLaunch", DeviceType.CPU),  # a graph's replay: one launch
        event("ampere_sgemm", DeviceType.CUDA, 3000.0),
        event("triton_decode", DeviceType.CUDA, 2000.0),
        event("Memcpy HtoD (Pinned -> Device)", DeviceType.CUDA, 1000.0),
    ] * 2  # two steps
    figures = device_figures(events, steps=2, step_s=0.012)
    assert figures == {
        "gpu_busy_ms_per_step": 6.0,
        "gpu_busy_fraction": 0.5,
        "kernel_launches_per_step": 3.0,
        "device_kernels_per_step": 2.0,
    }


def span(start: float, end: float, device: DeviceType = DeviceType.CUDA) -> SimpleNamespace:
    return SimpleNamespace(name="k", device_type=device, time_range=SimpleNamespace(start=start, end=end))


def test_device_idle_splits_short_and_long_gaps_and_merges_overlaps():
    events = [
        span(0, 10),
        span(12, 20),  # 2 us after the first: short
        span(15, 30),  # overlaps the one before (another stream): no gap
        span(31, 40),  # 1 us: short
        span(100, 110),  # 60 us: long, the device waited for the host
        span(40, 200, DeviceType.CPU),  # host events do not count
        span(113, 120),  # 3 us: short
    ]
    figures = device_idle(events, steps=2)
    assert figures["short_gaps_per_step"] == 1.5 and figures["short_gaps_ms_per_step"] == pytest.approx(0.003)
    assert figures["long_gaps_per_step"] == 0.5 and figures["long_gaps_ms_per_step"] == pytest.approx(0.030)
    assert device_idle([], steps=1)["long_gaps_ms_per_step"] == 0.0


def test_profile_cli_prints_and_writes_every_batchs_figures(tiny_model_dir, capsys, tmp_path):
    assert DEFAULT_BATCHES == (1, 64, 256)
    out = main(
        [
            "--model",
            str(tiny_model_dir),
            "--batch",
            "1,3",
            "--context",
            "32",
            "--steps",
            "2",
            "--max-model-len",
            "512",
            "--json",
            str(tmp_path / "profile.json"),
        ]
    )
    printed = capsys.readouterr().out
    assert printed.count("decode step:") == 2 and "moved >=" in printed and "host per step" in printed
    assert "no CUDA device" in printed
    written = json.loads((tmp_path / "profile.json").read_text())
    assert written == json.loads(json.dumps(out))
    assert written["device"] == "cpu" and written["copy_ceiling_gbs"] is None
    assert [figures["batch"] for figures in written["batches"]] == [1, 3]
    for figures in written["batches"]:
        assert figures["step_ms"] > 0 and figures["tok_s"] > 0 and figures["bytes_per_step"] > 0
        assert figures["gpu_busy_fraction"] is None and figures["kernel_launches_per_step"] is None
        assert figures["prepare_ms"] > 0
        assert {"schedule_ms", "prepare_ms", "execute_ms", "step_ms"} <= set(figures["host_ms"])
        assert figures["top_operators"] and figures["top_operators"][0]["calls_per_step"] > 0
    # The batch of 3's first prompt is the batch of 1's: one of its two 16-token blocks was cached.
    assert [figures["prefix_cache_hit_rate"] for figures in written["batches"]] == [0.0, 16 / 96]
    assert "prefix cache: 16.7% of the prompt tokens found cached" in printed


def test_the_steady_step_cancels_the_pipelines_fill_and_drain():
    # A run of n steps costs 2.6 ms a step plus 0.6 ms once (the first step prepared while the GPU
    # waits, the last one drained): 5 steps time 2.72 ms a step, the steady step is 2.6.
    def timed_run(n: int) -> float:
        return 0.6e-3 + n * 2.6e-3

    assert steady_step_seconds(timed_run, 5) == pytest.approx(2.6e-3)
    assert timed_run(5) / 5 == pytest.approx(2.72e-3)


def test_a_difference_lost_in_noise_falls_back_to_the_longer_runs_mean():
    times = iter([0.050, 0.040])  # the longer run came out shorter: noise, not a negative step
    assert steady_step_seconds(lambda n: next(times), 5, repeats=1) == pytest.approx(0.040 / 10)


def test_a_run_that_paid_for_a_compile_is_not_the_one_timed():
    # The first run of 5 steps met a kernel variant not compiled yet (0.3 s once); its repeat did not.
    spikes = iter([0.3, 0.0, 0.0, 0.0])

    def timed_run(n: int) -> float:
        return next(spikes) + 0.6e-3 + n * 2.6e-3

    assert steady_step_seconds(timed_run, 5) == pytest.approx(2.6e-3)


def test_profile_cli_profiles_sampled_steps_when_asked(tiny_model_dir, monkeypatch):
    """`--temperature 1.0 --top-p 0.9`: the profiled requests sample (the sampler's share of a step
    is what such a profile is for), and the figures say how they sampled."""
    used = []
    real = profile_module.SamplingParams

    def recording(**kwargs):
        used.append((kwargs["temperature"], kwargs["top_p"]))
        return real(**kwargs)

    monkeypatch.setattr(profile_module, "SamplingParams", recording)
    out = main(
        ["--model", str(tiny_model_dir), "--batch", "2", "--context", "16", "--steps", "2"]
        + ["--max-model-len", "256", "--temperature", "1.0", "--top-p", "0.9", "--no-tables"]
    )
    assert used == [(1.0, 0.9)] * 2  # each of the batch's requests (its own length a request)
    [figures] = out["batches"]
    assert (figures["temperature"], figures["top_p"]) == (1.0, 0.9) and figures["step_ms"] > 0


@pytest.fixture
def engines(monkeypatch) -> list[LLMEngine]:
    """Every engine the profile makes, kept for the test to inspect after main() returns."""
    made: list[LLMEngine] = []
    real = profile_module.LLMEngine

    def keeping(args):
        made.append(real(args))
        return made[-1]

    monkeypatch.setattr(profile_module, "LLMEngine", keeping)
    return made


def test_profile_cli_times_mixed_steps_with_a_prefill_chunk(tiny_model_dir, capsys, engines):
    """`--prefill-chunk 48`: every timed step carries a new 48-token prompt besides the batch's
    decodes (one prompt a step, none left waiting), the report says so, and once done the engine
    holds no request and no KV block of the profile's."""
    out = main(
        ["--model", str(tiny_model_dir), "--batch", "3", "--context", "32", "--steps", "2"]
        + ["--max-model-len", "256", "--prefill-chunk", "48", "--no-tables"]
    )
    [figures] = out["batches"]
    assert out["prefill_chunk"] == 48 and figures["prefill_chunk"] == 48
    assert figures["prompt_tokens_per_step"] == 48
    assert "mixed step:" in capsys.readouterr().out
    [engine] = engines
    assert not engine.has_unfinished_requests()
    assert engine.stats().kv_blocks_used == 0


def test_a_context_mix_gives_each_sequence_a_length_of_its_own(tiny_model_dir, capsys, engines):
    """`--context-mix 8,40`: each sequence's prompt drawn from the list (seeded: the same draw each
    run), the bytes a step moves counted from those lengths, the report naming the mean and the longest;
    a length that leaves no room to decode is refused by name."""
    assert batch_contexts(3, 32, ()) == [32, 32, 32]
    drawn = batch_contexts(6, 32, (8, 40))
    assert set(drawn) == {8, 40} and drawn == batch_contexts(6, 32, (8, 40))
    out = main(
        ["--model", str(tiny_model_dir), "--batch", "6", "--context-mix", "8,40", "--steps", "2"]
        + ["--max-model-len", "128", "--no-tables"]
    )
    [figures] = out["batches"]
    assert out["context_mix"] == [8, 40] and figures["longest_context"] == 40
    assert figures["context"] == round(sum(drawn) / 6)
    assert figures["bytes_per_step"] == bytes_per_decode_step(engines[0], drawn)
    printed = capsys.readouterr().out
    assert f"6 sequences of {figures['context']} tokens on average, 40 the longest" in printed
    with pytest.raises(SystemExit):
        main(["--model", str(tiny_model_dir), "--context-mix", "8,128", "--max-model-len", "128"])
    assert "a prompt of 128 tokens leaves no room to decode" in capsys.readouterr().err

"""`python -m engine.profile` runs on CPU and reports the step time and the bytes a step must move."""

from __future__ import annotations

from engine import EngineArgs, LLMEngine
from engine.profile import bytes_per_decode_step, main


def test_bytes_per_decode_step_counts_weights_once_and_each_sequence_kv(tiny_model_dir):
    engine = LLMEngine(
        EngineArgs(model=str(tiny_model_dir), device="cpu", num_kv_blocks=64, max_model_len=512)
    )
    weights = sum(p.numel() for p in engine.runner.model.parameters()) * 4  # float32, tied head counted once
    kv_per_token = 2 * 4 * 2 * 32 * 4  # K and V, 4 layers, 2 KV heads of 32, float32
    assert bytes_per_decode_step(engine, batch=3, context=100) == weights + 3 * 100 * kv_per_token


def test_profile_cli_prints_step_time_and_bandwidth(tiny_model_dir, capsys):
    main(
        [
            "--model",
            str(tiny_model_dir),
            "--batch",
            "2",
            "--context",
            "32",
            "--steps",
            "2",
            "--max-model-len",
            "512",
        ]
    )
    out = capsys.readouterr().out
    assert "decode step:" in out and "moved >=" in out

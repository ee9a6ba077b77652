"""engine.kernels.bench_gemm's arithmetic and command line (the timing itself needs CUDA: device only)."""

from __future__ import annotations

import argparse

import pytest
import torch

from engine.kernels import bench_gemm


def test_layer_cost_counts_every_projection_once():
    per_layer_flops = 2 * sum(n * k for _, n, k in bench_gemm.SHAPES)
    # qwen2.5-1.5b: 1536 x (2048 + 1536 + 17920) + 8960 x 1536 weights a layer
    assert per_layer_flops == 2 * (1536 * (2048 + 1536 + 17920) + 8960 * 1536)
    cost = bench_gemm.layer_cost(
        1000, {"qkv_proj": 10.0, "o_proj": 5.0, "gate_up_proj": 60.0, "down_proj": 25.0}
    )
    assert cost.layer_us == pytest.approx(100.0)
    assert cost.ns_per_token == pytest.approx(100.0)  # 100 us over 1,000 rows
    assert cost.tflops == pytest.approx(1000 * per_layer_flops / 100e-6 / 1e12)


def test_rows_parse_and_bad_rows_are_refused():
    assert bench_gemm.parse_rows("128, 256,4224") == (128, 256, 4224)
    for bad in ("", "0,128", "-4"):
        with pytest.raises(argparse.ArgumentTypeError, match="--rows"):
            bench_gemm.parse_rows(bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
def test_without_cuda_it_says_so(capsys):
    assert bench_gemm.main(["--rows", "128"]) == 2
    assert "CUDA" in capsys.readouterr().err

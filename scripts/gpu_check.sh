#!/usr/bin/env bash
# On a CUDA machine: the GPU tests (kernels against their torch references, graphs against eager,
# bf16 against transformers), the kernel micro-benchmarks, and the decode-step profile of the
# qwen2.5-1.5b preset at 1, 64 and 256 sequences. Writes logs and JSON into OUT_DIR (default: $OUT).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:?give an output folder}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
[ -d /tmp/qwen ] || python3 -m engine.synthetic --preset qwen2.5-1.5b --out /tmp/qwen --dtype bfloat16 >/dev/null
python3 -m pytest tests/unit/kernels -q -m "gpu or not gpu" 2>&1 | tee "$out/kernels.log" | tail -5
for bench in ${GPU_CHECK_BENCHES:-bench_attention bench_elementwise}; do
  [ -f "engine/kernels/$bench.py" ] && python3 -m "engine.kernels.$bench" --json "$out/$bench.json" 2>&1 | tail -30
done
python3 -m pytest tests/unit/engine/test_gpu.py -q -x 2>&1 | tee "$out/engine_gpu.log" | tail -5
for batch in ${GPU_CHECK_BATCHES:-1 64 256}; do
  python3 -m engine.profile --model /tmp/qwen --batch "$batch" --context 1024 --steps 20 2>&1 \
    | tee "$out/profile_b$batch.txt" | head -60
done

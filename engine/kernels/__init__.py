"""Triton kernels for the GPU fast path: one kernel family a module, each with a plain launcher.

Modules here know tensors and shapes only, nothing of the model or the scheduler. Each kernel has a
torch reference and tests that run on CUDA and, on CPU, through Triton's interpreter
(`TRITON_INTERPRET=1`, set before triton is imported: `scripts/test.sh` runs tests/unit/kernels so).
"""

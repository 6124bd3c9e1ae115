"""Triton kernels for the hot paths, one folder per op: `helexa_kernels/<op>/{naive,triton}.py`.

`naive.py` is the plain PyTorch reference (what the engine runs on CPU, and what the Triton
version is tested against); `triton.py` holds the `<op>_fwd_kernel` and its launcher. Each op's
`__init__` exports both. Tensors are token-major and flat (`[num_tokens, ...]` plus `cu_seqlens`
for varlen batches), as the engine lays out a step.

Tests (tests/kernels) run each Triton op against its reference in Triton's CPU interpreter on
tiny shapes, compile every kernel for sm_90 with Triton's bundled ptxas, and run full shapes
on a GPU when there is one; benchmarks/gpu_kernels.py times them against the references.
"""

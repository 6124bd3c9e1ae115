"""What the kernel tests share: the device they run on and error ratios (full-size shapes carry
the `gpu` marker, which tests/conftest.py skips without CUDA)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from engine.cpu.cpu_support import dtype_supported
from helexa_kernels import cpu as cpu_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The C++ CPU kernels' forms on a CPU with AMX: as they pick (AMX where it applies), and with AMX
# switched off (their AVX-512 forms). Elsewhere the two are the same form, run twice.
AMX_FORMS = [pytest.param(nullcontext, id="picked"), pytest.param(cpu_kernels.amx_off, id="avx512")]

# bf16's packed linears and decode kernels exist only on CPUs that run bf16 (oneDNN's own check:
# AVX-512 BW/VL/DQ or AVX-NE-CONVERT); elsewhere a bf16 model runs unpacked, as the tests of the
# "bf16 unsupported" path check on every machine (they force it), and these cases cannot run.
NEEDS_BF16_CPU = pytest.mark.skipif(not dtype_supported("bfloat16"),
                                    reason="this CPU cannot run bf16 (oneDNN): no bf16 kernels here")
BF16 = pytest.param(torch.bfloat16, id="bf16", marks=NEEDS_BF16_CPU)

def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in fp64 (the plain norm of the difference when expected is 0)."""
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    diff = (actual - expected).norm().item()
    return diff / denom if denom else diff


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, name: str = "out") -> None:
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    err = rel_err(actual, expected)
    assert err < tol, f"{name}: relative error {err:.2e} >= {tol:.0e}"


def tol_for(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]

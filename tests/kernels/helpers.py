"""What the kernel tests share: the device they run on and error ratios (full-size shapes carry
the `gpu` marker, which tests/conftest.py skips without CUDA)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from helexa_kernels import cpu as cpu_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# The C++ CPU kernels' forms on a CPU with AMX: as they pick (AMX where it applies), and with AMX
# switched off (their AVX-512 forms). Elsewhere the two are the same form, run twice.
AMX_FORMS = [pytest.param(nullcontext, id="picked"), pytest.param(cpu_kernels.amx_off, id="avx512")]

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

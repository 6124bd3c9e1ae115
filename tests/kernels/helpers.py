"""What the kernel tests share: the device they run on, error ratios, the gpu marker."""

from __future__ import annotations

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def gpu(test):
    """Full-size shapes: compiled on a GPU only (the interpreter would take minutes)."""
    return pytest.mark.gpu(_needs_cuda(test))


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

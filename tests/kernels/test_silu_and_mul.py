from __future__ import annotations

import pytest
import torch

from helexa_kernels.silu_and_mul import naive_silu_and_mul, silu_and_mul
from tests.kernels.helpers import DEVICE, assert_close, tol_for

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [pytest.param((4, 64), id="4x64"),
                                   pytest.param((2, 3, 2 * 3000), id="2x3x6000-multi-tile")])
def test_silu_and_mul(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x = torch.randn(shape, device=DEVICE).to(dtype)
    out = silu_and_mul(x)
    assert out.shape == (*shape[:-1], shape[-1] // 2)
    assert_close(out, naive_silu_and_mul(x), tol_for(dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_size(dtype: torch.dtype) -> None:
    x = torch.randn(1024, 2 * 12288, device=DEVICE).to(dtype)
    assert_close(silu_and_mul(x), naive_silu_and_mul(x), tol_for(dtype))

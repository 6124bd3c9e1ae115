from __future__ import annotations

import pytest
import torch

from helexa_kernels.rmsnorm import (
    fused_add_rms_norm,
    gated_rms_norm,
    naive_fused_add_rms_norm,
    naive_gated_rms_norm,
    naive_rms_norm,
    rms_norm,
)
from tests.kernels.helpers import DEVICE, assert_close, tol_for

SHAPES = [pytest.param((3, 32), id="3x32"), pytest.param((2, 3, 48), id="2x3x48-nonpow2")]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _inputs(shape: tuple[int, ...], dtype: torch.dtype):
    x = torch.randn(shape, device=DEVICE).to(dtype)
    w = (torch.randn(shape[-1], device=DEVICE) * 0.1 + 1).to(dtype)
    return x, w


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, unit_offset: bool) -> None:
    x, w = _inputs(shape, dtype)
    out = rms_norm(x, w, 1e-6, unit_offset=unit_offset)
    assert out.dtype == dtype
    assert_close(out, naive_rms_norm(x, w, 1e-6, unit_offset=unit_offset), tol_for(dtype))


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rms_norm(shape: tuple[int, ...], dtype: torch.dtype, unit_offset: bool) -> None:
    x, w = _inputs(shape, dtype)
    residual = torch.randn(shape, device=DEVICE).to(dtype)
    ref_residual = residual.clone()
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6, unit_offset=unit_offset)
    ref_out, ref_new_residual = naive_fused_add_rms_norm(x, ref_residual, w, 1e-6,
                                                         unit_offset=unit_offset)
    assert new_residual is residual
    assert_close(new_residual, ref_new_residual, tol_for(dtype), "residual")
    assert_close(out, ref_out, tol_for(dtype), "out")


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
def test_fused_add_into_an_fp32_residual_stream(unit_offset: bool) -> None:
    """A bf16 model's residual stream is fp32 (engine.models.layers.residual_stream): the sum is
    kept unrounded, the norm comes out in x's dtype."""
    x, w = _inputs((3, 48), torch.bfloat16)
    residual = torch.randn((3, 48), device=DEVICE)
    expected_sum = residual + x.float()
    ref_out, _ = naive_fused_add_rms_norm(x, residual.clone(), w, 1e-6, unit_offset=unit_offset)
    out, new_residual = fused_add_rms_norm(x, residual, w, 1e-6, unit_offset=unit_offset)
    assert new_residual is residual and residual.dtype == torch.float32 and out.dtype == torch.bfloat16
    assert_close(new_residual, expected_sum, tol_for(torch.float32), "residual")
    assert_close(out, ref_out, tol_for(torch.bfloat16), "out")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_rms_norm(shape: tuple[int, ...], dtype: torch.dtype) -> None:
    x, w = _inputs(shape, dtype)
    z = torch.randn(shape, device=DEVICE).to(dtype)
    assert_close(gated_rms_norm(x, z, w), naive_gated_rms_norm(x, z, w), tol_for(dtype))


def test_matches_the_engine_norm() -> None:
    from engine.models.layers import RMSNorm

    norm = RMSNorm(40, 1e-5).to(DEVICE)
    norm.weight.data.normal_()
    x = torch.randn(5, 40, device=DEVICE)
    assert_close(rms_norm(x, norm.weight.data, 1e-5), norm(x), 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("hidden", [4096, 5120], ids=["4096", "5120"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_size(dtype: torch.dtype, hidden: int) -> None:
    x, w = _inputs((512, hidden), dtype)
    residual = torch.randn_like(x)
    out, _ = fused_add_rms_norm(x, residual.clone(), w, unit_offset=True)
    assert_close(out, naive_fused_add_rms_norm(x, residual.clone(), w, unit_offset=True)[0],
                 tol_for(dtype))
    z = torch.randn_like(x)
    assert_close(gated_rms_norm(x, z, w), naive_gated_rms_norm(x, z, w), tol_for(dtype))

"""The few-call PyTorch forms of the hot ops (`helexa_kernels/<op>/aten.py`) against the plain references."""

from __future__ import annotations

import pytest
import torch

from helexa_kernels.kv_store import aten as kv_store_aten
from helexa_kernels.kv_store.naive import naive_kv_store
from helexa_kernels.rmsnorm import aten as rmsnorm_aten
from helexa_kernels.rmsnorm.naive import naive_fused_add_rms_norm, naive_rms_norm
from helexa_kernels.rotary import aten as rotary_aten
from helexa_kernels.rotary.naive import build_cos_sin_cache, naive_rotary
from helexa_kernels.silu_and_mul import aten as silu_and_mul_aten
from helexa_kernels.silu_and_mul.naive import naive_silu_and_mul

DTYPES = {"fp32": (torch.float32, 1e-6), "bf16": (torch.bfloat16, 1e-2)}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_norms_match_the_references(dtype: str, unit_offset: bool) -> None:
    torch_dtype, tolerance = DTYPES[dtype]
    x = torch.randn(7, 3, 64).to(torch_dtype)
    weight = (torch.randn(64) * 0.1 + (0 if unit_offset else 1)).to(torch_dtype)
    out = rmsnorm_aten.rms_norm(x, weight, 1e-6, unit_offset=unit_offset)
    assert out.dtype == torch_dtype
    assert rel_error(out, naive_rms_norm(x, weight, 1e-6, unit_offset=unit_offset)) < tolerance
    residual, residual_ref = torch.randn(7, 3, 64).to(torch_dtype), None
    residual_ref = residual.clone()
    normed, summed = rmsnorm_aten.fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset=unit_offset)
    normed_ref, summed_ref = naive_fused_add_rms_norm(x, residual_ref, weight, 1e-6, unit_offset=unit_offset)
    assert summed is residual and torch.equal(summed, summed_ref)  # in place, same rounding
    assert rel_error(normed, normed_ref) < tolerance


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
def test_an_fp32_residual_stream_of_a_bf16_model_is_normed_as_the_reference(unit_offset: bool) -> None:
    x = torch.randn(7, 64).to(torch.bfloat16)
    weight = (torch.randn(64) * 0.1 + (0 if unit_offset else 1)).to(torch.bfloat16)
    residual = torch.randn(7, 64)
    residual_ref = residual.clone()
    normed, summed = rmsnorm_aten.fused_add_rms_norm(x, residual, weight, 1e-6, unit_offset=unit_offset)
    normed_ref, summed_ref = naive_fused_add_rms_norm(x, residual_ref, weight, 1e-6, unit_offset=unit_offset)
    assert summed is residual and summed.dtype == torch.float32 and normed.dtype == torch.bfloat16
    assert torch.equal(summed, summed_ref)
    assert rel_error(normed, normed_ref) < 1e-2


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_silu_and_mul_matches_the_reference(dtype: str) -> None:
    torch_dtype, tolerance = DTYPES[dtype]
    x = torch.randn(5, 2 * 96).to(torch_dtype)
    assert rel_error(silu_and_mul_aten.silu_and_mul(x), naive_silu_and_mul(x)) < tolerance


@pytest.mark.parametrize("rotary_dim", [64, 16], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
def test_rotary_matches_the_reference(dtype: str, rotary_dim: int) -> None:
    torch_dtype, tolerance = DTYPES[dtype]
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    table = build_cos_sin_cache(inv_freq, 256)
    positions = torch.tensor([0, 5, 17, 200, 3])
    tables = rotary_aten.rotary_tables(positions, table)  # once per step, for every layer
    for _ in range(2):
        q, k = torch.randn(5, 4, 64).to(torch_dtype), torch.randn(5, 2, 64).to(torch_dtype)
        out_q, out_k = rotary_aten.rotary(q, k, tables)
        ref_q, ref_k = naive_rotary(q, k, positions, table)
        assert out_q.dtype == torch_dtype
        assert rel_error(out_q, ref_q) < tolerance and rel_error(out_k, ref_k) < tolerance


@pytest.mark.parametrize("slots_valid", [True, False], ids=["no-padding", "padding"])
def test_kv_store_matches_the_reference(slots_valid: bool) -> None:
    cache_shape = (6, 4, 2, 8)
    slots = torch.tensor([17, 2, 9, 3] if slots_valid else [17, -1, 9, -1])
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    caches = [torch.zeros(cache_shape) for _ in range(4)]
    kv_store_aten.kv_store(k, v, caches[0], caches[1], slots, slots_valid)
    naive_kv_store(k, v, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])

"""The C++ CPU norms, rotary, SiLU-and-mul and KV store (helexa_kernels/<op>/cpu_*.cpp) against their
naive references. They must build wherever the suite runs (CI has a compiler)."""

from __future__ import annotations

import pytest
import torch

from helexa_kernels import cpu as cpu_kernels
from helexa_kernels.kv_store.naive import naive_kv_store
from helexa_kernels.rmsnorm.naive import naive_fused_add_rms_norm, naive_rms_norm
from helexa_kernels.rotary.naive import build_cos_sin_cache, naive_rotary
from helexa_kernels.silu_and_mul.naive import naive_silu_and_mul

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16"),
          pytest.param(torch.float16, id="fp16")]


@pytest.fixture(scope="module", autouse=True)
def built() -> None:
    assert cpu_kernels.load(), "the CPU kernels did not build on this machine"


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Both compute in fp32 and round once: equal up to one rounding step of the dtype."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-3}[actual.dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_matches_reference(dtype: torch.dtype, unit_offset: bool) -> None:
    x = torch.randn(5, 3, 40).to(dtype)  # 3-D: the norm is over the last dim of every row
    weight = torch.randn(40).to(dtype)
    assert_same(cpu_kernels.rms_norm(x, weight, 1e-6, unit_offset),
                naive_rms_norm(x, weight, 1e-6, unit_offset=unit_offset))


def test_rms_norm_reads_strided_rows() -> None:
    wide = torch.randn(7, 50)
    x = wide[:, 3:43]  # rows 50 apart
    weight = torch.randn(40)
    assert_same(cpu_kernels.rms_norm(x, weight, 1e-5), naive_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("residual_dtype", [torch.float32, None], ids=["fp32-stream", "same-dtype"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_matches_reference(dtype: torch.dtype,
                                              residual_dtype: torch.dtype | None) -> None:
    x = torch.randn(9, 64).to(dtype)
    residual = torch.randn(9, 64).to(residual_dtype or dtype)
    weight = torch.randn(64).to(dtype)
    expected_residual = residual.clone()
    expected, _ = naive_fused_add_rms_norm(x, expected_residual, weight, 1e-6)
    out, stream = cpu_kernels.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert stream is residual  # updated in place, as the model's residual stream expects
    assert_same(residual, expected_residual)
    assert_same(out, expected)


@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_matches_reference_in_place(dtype: torch.dtype, rotary_dim: int) -> None:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2).float() / rotary_dim))
    table = build_cos_sin_cache(inv_freq, 300)
    # q and k side by side in one packed projection output, as a model's qkv split gives them
    qkv = torch.randn(6, (4 + 2 + 2) * 64).to(dtype)
    q = qkv[:, :4 * 64].view(6, 4, 64)
    k = qkv[:, 4 * 64:6 * 64].view(6, 2, 64)
    v_before = qkv[:, 6 * 64:].clone()
    positions = torch.tensor([0, 1, 7, 299, 150, 3])
    expected_q, expected_k = naive_rotary(q.clone(), k.clone(), positions, table)
    rotated_q, rotated_k = cpu_kernels.rotary_(q, k, positions, table)
    assert rotated_q is q and rotated_k is k
    assert_same(q, expected_q)
    assert_same(k, expected_k)
    assert torch.equal(qkv[:, 6 * 64:], v_before)  # v is not touched


def test_rotary_refuses_a_position_outside_its_table() -> None:
    table = build_cos_sin_cache(torch.ones(8), 10)
    q, k = torch.randn(2, 1, 16), torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match="outside the rotary table"):
        cpu_kernels.rotary_(q, k, torch.tensor([3, 10]), table)


@pytest.mark.parametrize("width", [1536, 37], ids=["smollm2", "odd-tail"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_reference(dtype: torch.dtype, width: int) -> None:
    x = (torch.randn(3, 5, 2 * width) * 4).to(dtype)  # large |gate| too: exp's range matters
    assert_same(cpu_kernels.silu_and_mul(x), naive_silu_and_mul(x))


def test_silu_and_mul_reads_a_strided_projection() -> None:
    wide = torch.randn(4, 2 * 64 + 9)
    x = wide[:, :128]
    assert_same(cpu_kernels.silu_and_mul(x), naive_silu_and_mul(x))


def _caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(6, 4, 3, 16, dtype=dtype), torch.zeros(6, 4, 3, 16, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kv_store_matches_reference(dtype: torch.dtype) -> None:
    # k and v as the model hands them over: views into one packed qkv projection, rows 9 heads apart.
    qkv = torch.randn(5, (3 + 3 + 3) * 16).to(dtype)
    k, v = qkv[:, 48:96].view(5, 3, 16), qkv[:, 96:].view(5, 3, 16)
    slots = torch.tensor([0, 23, -1, 7, 12])  # -1: a padding row, skipped
    expected, got = _caches(dtype), _caches(dtype)
    naive_kv_store(k, v, *expected, slots)
    cpu_kernels.kv_store(k, v, *got, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_kv_store_copies_heads_that_are_not_side_by_side() -> None:
    k = torch.randn(2, 3, 16)  # heads side by side
    strided = torch.randn(2, 6, 16)[:, ::2]  # heads two rows apart
    expected, got = _caches(torch.float32), _caches(torch.float32)
    slots = torch.tensor([3, 9])
    naive_kv_store(k, strided, *expected, slots)
    cpu_kernels.kv_store(k, strided, *got, slots)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_kv_store_refuses_a_slot_outside_the_cache_before_writing() -> None:
    k = torch.randn(2, 3, 16)
    caches = _caches(torch.float32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_kernels.kv_store(k, k, *caches, torch.tensor([1, 24]))
    assert not caches[0].any() and not caches[1].any()

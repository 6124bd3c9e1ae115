from __future__ import annotations

import pytest
import torch

from helexa_kernels.rotary import build_cos_sin_cache, naive_rotary, rotary
from tests.kernels.helpers import DEVICE, assert_close, tol_for

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]


def _cache(rotary_dim: int, max_position: int = 64) -> torch.Tensor:
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, device=DEVICE).float() / rotary_dim))
    return build_cos_sin_cache(inv_freq, max_position)


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "in-place"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,rotary_dim", [pytest.param(32, 32, id="full-32"),
                                                 pytest.param(32, 8, id="partial-8of32"),
                                                 pytest.param(24, 12, id="partial-12of24")])
def test_rotary(head_dim: int, rotary_dim: int, dtype: torch.dtype, inplace: bool) -> None:
    q = torch.randn(5, 4, head_dim, device=DEVICE).to(dtype)
    k = torch.randn(5, 2, head_dim, device=DEVICE).to(dtype)
    positions = torch.tensor([0, 7, 3, 63, 20], device=DEVICE)
    cache = _cache(rotary_dim)
    ref_q, ref_k = naive_rotary(q, k, positions, cache)
    q_in, k_in = q.clone(), k.clone()
    out_q, out_k = rotary(q_in, k_in, positions, cache, inplace=inplace)
    assert_close(out_q, ref_q, tol_for(dtype), "q")
    assert_close(out_k, ref_k, tol_for(dtype), "k")
    assert (out_q.data_ptr() == q_in.data_ptr()) == inplace
    if not inplace:
        assert torch.equal(q_in, q) and torch.equal(k_in, k)
    assert torch.equal(out_q[..., rotary_dim:], q[..., rotary_dim:])


def test_strided_views_of_fused_qkv() -> None:
    qkv = torch.randn(6, (4 + 2 + 2) * 16, device=DEVICE)
    q, k, _ = qkv.view(6, 8, 16).split([4, 2, 2], dim=1)
    positions = torch.arange(6, device=DEVICE)
    cache = _cache(16)
    ref_q, ref_k = naive_rotary(q, k, positions, cache)
    rotary(q, k, positions, cache, inplace=True)
    assert_close(qkv.view(6, 8, 16)[:, :4], ref_q, 1e-6, "q")
    assert_close(qkv.view(6, 8, 16)[:, 4:6], ref_k, 1e-6, "k")


def _rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's formulation: x * cos + rotate_half(x) * sin, with cos/sin repeated over both halves."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]


def test_matches_the_hf_formulation() -> None:
    q = torch.randn(5, 3, 32, device=DEVICE)
    positions = torch.tensor([0, 1, 9, 4, 30], device=DEVICE)
    cache = _cache(32)
    cos, sin = cache[positions].chunk(2, dim=-1)
    ref = _rotate_half_reference(q, torch.cat((cos, cos), -1), torch.cat((sin, sin), -1))
    assert_close(rotary(q, q[:, :1], positions, cache)[0], ref, 1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_size(dtype: torch.dtype) -> None:
    q = torch.randn(2048, 32, 128, device=DEVICE).to(dtype)
    k = torch.randn(2048, 8, 128, device=DEVICE).to(dtype)
    positions = torch.randint(0, 4096, (2048,), device=DEVICE)
    cache = _cache(64, 4096)
    for out, ref in zip(rotary(q, k, positions, cache), naive_rotary(q, k, positions, cache), strict=True):
        assert_close(out, ref, tol_for(dtype))

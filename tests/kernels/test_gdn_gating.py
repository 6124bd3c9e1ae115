from __future__ import annotations

import pytest
import torch

from helexa_kernels.gdn_gating import gdn_gating, naive_gdn_gating
from tests.kernels.helpers import DEVICE, assert_close


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("heads", [4, 6], ids=["hv4", "hv6"])
def test_gdn_gating(heads: int, dtype: torch.dtype) -> None:
    A_log = torch.randn(heads, device=DEVICE)
    dt_bias = torch.randn(heads, device=DEVICE)
    ba = torch.randn(5, 2 * heads, device=DEVICE) * 8  # a strided view, as from a fused projection
    ba[0, heads] = 40.0  # past the softplus threshold
    b, a = ba[:, :heads].to(dtype), ba[:, heads:].to(dtype)
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    ref_g, ref_beta = naive_gdn_gating(A_log, a, b, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    assert_close(g, ref_g, 1e-5, "g")
    assert_close(beta, ref_beta, 1e-5, "beta")
    assert (g <= 0).all()


def test_softplus_beta_and_threshold() -> None:
    a = torch.linspace(-30, 30, 24, device=DEVICE).view(4, 6)
    args = (torch.zeros(6, device=DEVICE), a, a, torch.zeros(6, device=DEVICE))
    g, _ = gdn_gating(*args, softplus_beta=2.0, softplus_threshold=10.0)
    ref_g, _ = naive_gdn_gating(*args, softplus_beta=2.0, softplus_threshold=10.0)
    assert_close(g, ref_g, 1e-5)


@pytest.mark.gpu
def test_full_size() -> None:
    args = (torch.randn(64, device=DEVICE), torch.randn(8192, 64, device=DEVICE),
            torch.randn(8192, 64, device=DEVICE), torch.randn(64, device=DEVICE))
    for out, ref in zip(gdn_gating(*args), naive_gdn_gating(*args), strict=True):
        assert_close(out, ref, 1e-5)

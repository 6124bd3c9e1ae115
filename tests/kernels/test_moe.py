from __future__ import annotations

import pytest
import torch

from helexa_kernels.moe import (
    fused_moe,
    grouped_matmul,
    moe_routing,
    naive_fused_moe,
    naive_grouped_matmul,
    naive_moe_routing,
)
from tests.kernels.helpers import DEVICE, assert_close, tol_for

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TILES = {"block_m": 16, "block_n": 16, "block_k": 16}


@pytest.mark.parametrize("renormalize", [True, False], ids=["renorm", "no-renorm"])
@pytest.mark.parametrize("experts,top_k", [pytest.param(8, 2, id="e8-k2"),
                                           pytest.param(12, 3, id="e12-k3"),
                                           pytest.param(5, 5, id="e5-k5-all")])
def test_routing(experts: int, top_k: int, renormalize: bool) -> None:
    logits = torch.randn(7, experts, device=DEVICE)
    weights, ids = moe_routing(logits, top_k, renormalize)
    ref_weights, ref_ids = naive_moe_routing(logits, top_k, renormalize)
    assert ids.dtype == torch.int32 and torch.equal(ids, ref_ids)
    assert_close(weights, ref_weights, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("counts", [pytest.param([5, 0, 12, 3], id="with-empty-expert"),
                                    pytest.param([0, 0, 33, 0], id="one-expert-many-tiles")])
def test_grouped_matmul(counts: list[int], dtype: torch.dtype) -> None:
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], device=DEVICE)
    x = torch.randn(sum(counts), 40, device=DEVICE).to(dtype)
    w = torch.randn(len(counts), 24, 40, device=DEVICE).to(dtype)
    assert_close(grouped_matmul(x, w, offsets, **TILES), naive_grouped_matmul(x, w, offsets),
                 tol_for(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_moe(dtype: torch.dtype) -> None:
    tokens, hidden, inter, experts, top_k = 9, 32, 24, 6, 3
    x = torch.randn(tokens, hidden, device=DEVICE).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) * 0.2).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, device=DEVICE) * 0.2).to(dtype)
    weights, ids = naive_moe_routing(torch.randn(tokens, experts, device=DEVICE), top_k, True)
    assert_close(fused_moe(x, w13, w2, weights, ids, **TILES),
                 naive_fused_moe(x, w13, w2, weights, ids), 2 * tol_for(dtype))


@pytest.mark.gpu
def test_full_size() -> None:
    # Qwen3-30B-A3B: 128 experts, top 8, hidden 2048, expert intermediate 768.
    tokens, hidden, inter, experts, top_k = 512, 2048, 768, 128, 8
    x = torch.randn(tokens, hidden, device=DEVICE, dtype=torch.bfloat16)
    w13 = (torch.randn(experts, 2 * inter, hidden, device=DEVICE) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn(experts, hidden, inter, device=DEVICE) * 0.02).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, device=DEVICE)
    weights, ids = moe_routing(logits, top_k, True)
    ref_weights, ref_ids = naive_moe_routing(logits, top_k, True)
    assert torch.equal(ids, ref_ids)
    assert_close(weights, ref_weights, 1e-5)
    assert_close(fused_moe(x, w13, w2, weights, ids), naive_fused_moe(x, w13, w2, weights, ids),
                 2e-2)

from __future__ import annotations

import pytest
import torch

from helexa_kernels.kv_store import kv_store, naive_kv_store
from tests.kernels.helpers import DEVICE


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"),
                                   pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("kv_heads,head_dim", [pytest.param(2, 16, id="2x16"),
                                               pytest.param(3, 24, id="3x24-nonpow2")])
def test_kv_store(kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    num_blocks, block_size = 4, 4
    k = torch.randn(6, kv_heads, head_dim, device=DEVICE).to(dtype)
    v = torch.randn(6, kv_heads, head_dim, device=DEVICE).to(dtype)
    slot_mapping = torch.tensor([5, 0, -1, 15, 9, -1], device=DEVICE)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    caches = [torch.full(shape, 7.0, device=DEVICE).to(dtype) for _ in range(4)]
    kv_store(k, v, caches[0], caches[1], slot_mapping)
    naive_kv_store(k, v, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    flat = caches[0].view(-1, kv_heads, head_dim)
    assert torch.equal(flat[15], k[3]) and (flat[1] == 7).all()  # untouched slots keep their value


def test_strided_keys() -> None:
    kv = torch.randn(5, 2, 2, 16, device=DEVICE)  # [num_tokens, k|v, kv_heads, head_dim]
    k, v = kv[:, 0], kv[:, 1]
    slot_mapping = torch.tensor([3, 2, 1, 0, 7], device=DEVICE)
    caches = [torch.zeros(2, 4, 2, 16, device=DEVICE) for _ in range(4)]
    kv_store(k, v, caches[0], caches[1], slot_mapping)
    naive_kv_store(k, v, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.gpu
def test_full_size() -> None:
    k = torch.randn(4096, 8, 128, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slot_mapping = torch.randperm(1024 * 16, device=DEVICE)[:4096]
    caches = [torch.zeros(1024, 16, 8, 128, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    kv_store(k, v, caches[0], caches[1], slot_mapping)
    naive_kv_store(k, v, caches[2], caches[3], slot_mapping)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])

from __future__ import annotations

import pytest
import torch

from helexa_kernels.rotary import build_cos_sin_cache
from helexa_kernels.rotary_kv_store import naive_rotary_kv_store, rotary_kv_store
from tests.kernels.helpers import DEVICE, assert_close, tol_for

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
NORMS = [pytest.param(None, id="no-norm"), pytest.param(False, id="qk-norm"),
         pytest.param(True, id="qk-norm-1+w")]


def _cache(rotary_dim: int, max_position: int = 64) -> torch.Tensor:
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, rotary_dim, 2, device=DEVICE).float() / rotary_dim))
    return build_cos_sin_cache(inv_freq, max_position)


def _case(num_tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
          q_width: int = 1) -> tuple[torch.Tensor, ...]:
    """q, k, v as views of one packed projection (q heads `q_width` times as wide, as a gated
    query's [query | gate] is), and the projection itself."""
    qkv = torch.randn(num_tokens, (heads * q_width + 2 * kv_heads) * head_dim, device=DEVICE).to(dtype)
    q, k, v = qkv.split([heads * q_width * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q = q.view(num_tokens, heads, q_width * head_dim)[..., :head_dim]
    return q, k.view(num_tokens, kv_heads, head_dim), v.view(num_tokens, kv_heads, head_dim), qkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("unit_offset", NORMS)
@pytest.mark.parametrize("heads,kv_heads,head_dim,rotary_dim,q_width", [
    pytest.param(4, 2, 16, 16, 1, id="gqa2-full"),
    pytest.param(8, 2, 32, 8, 2, id="gqa4-partial-gated"),
    pytest.param(3, 3, 24, 12, 1, id="mha-nonpow2"),
])
def test_rotary_kv_store(heads: int, kv_heads: int, head_dim: int, rotary_dim: int, q_width: int,
                         unit_offset: bool | None, dtype: torch.dtype) -> None:
    q, k, v, qkv = _case(6, heads, kv_heads, head_dim, dtype, q_width)
    positions = torch.tensor([0, 7, 3, 63, 20, 5], device=DEVICE)
    slot_mapping = torch.tensor([5, 0, -1, 15, 9, -1], device=DEVICE)
    cache = _cache(rotary_dim)
    weights = {}
    if unit_offset is not None:
        weights = {"q_norm_weight": torch.randn(head_dim, device=DEVICE).to(dtype),
                   "k_norm_weight": torch.randn(head_dim, device=DEVICE).to(dtype),
                   "eps": 1e-6, "unit_offset": unit_offset}
    shape = (4, 4, kv_heads, head_dim)
    caches = [torch.full(shape, 7.0, device=DEVICE).to(dtype) for _ in range(4)]
    ref_q, ref_k = naive_rotary_kv_store(q, k, v, positions, cache, caches[2], caches[3],
                                         slot_mapping, **weights)
    before = qkv.clone()
    out_q, out_k = rotary_kv_store(q, k, v, positions, cache, caches[0], caches[1], slot_mapping,
                                   **weights)
    tol = tol_for(dtype)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()  # in place
    assert_close(out_q, ref_q, tol, "q")
    assert_close(out_k, ref_k, tol, "k")
    assert_close(caches[0], caches[2], tol, "k_cache")
    assert torch.equal(caches[1], caches[3])  # v is copied as it is
    flat = caches[0].view(-1, kv_heads, head_dim)
    assert (flat[1] == 7).all()  # slots nobody writes keep their value
    # Only q and k moved: v and a gated query's gate are left as they were.
    q_size = heads * q_width * head_dim
    assert torch.equal(qkv[:, q_size + kv_heads * head_dim:], before[:, q_size + kv_heads * head_dim:])
    if q_width > 1:
        gate = qkv[:, :q_size].view(6, heads, q_width * head_dim)[..., head_dim:]
        assert torch.equal(gate, before[:, :q_size].view(6, heads, -1)[..., head_dim:])


def test_rounds_like_the_separate_kernels() -> None:
    """bf16: the norm's output is rounded before the rotation reads it, as the separate Triton
    kernels (norm, rotary, KV store) do, so the fused and unfused Triton paths agree to a rare
    last-bit difference where fp32 sums reorder, far below bf16's tolerance against the reference."""
    from helexa_kernels.kv_store import kv_store
    from helexa_kernels.rmsnorm import rms_norm
    from helexa_kernels.rotary import rotary

    q, k, v, _ = _case(5, 4, 2, 32, torch.bfloat16)
    positions = torch.arange(5, device=DEVICE) * 9
    slots = torch.arange(5, device=DEVICE)
    q_w, k_w = torch.randn(32, device=DEVICE), torch.randn(32, device=DEVICE)
    caches = [torch.zeros(2, 4, 2, 32, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    ref_q, ref_k = rotary(rms_norm(q, q_w), rms_norm(k, k_w), positions, _cache(32), inplace=True)
    kv_store(ref_k, v, caches[2], caches[3], slots)
    out_q, out_k = rotary_kv_store(q, k, v, positions, _cache(32), caches[0], caches[1], slots,
                                   q_w, k_w)
    assert_close(out_q, ref_q, 1e-3, "q")
    assert_close(out_k, ref_k, 1e-3, "k")
    assert_close(caches[0], caches[2], 1e-3, "k_cache")


def test_checks_its_inputs() -> None:
    q, k, v, _ = _case(2, 4, 2, 16, torch.float32)
    caches = [torch.zeros(2, 4, 2, 16, device=DEVICE) for _ in range(2)]
    args = (torch.zeros(2, dtype=torch.long, device=DEVICE), _cache(16), *caches,
            torch.zeros(2, dtype=torch.long, device=DEVICE))
    with pytest.raises(ValueError, match="multiple"):
        rotary_kv_store(q[:, :3], k, v, *args)
    with pytest.raises(ValueError, match="together"):
        rotary_kv_store(q, k, v, *args, q_norm_weight=torch.ones(16, device=DEVICE))
    with pytest.raises(ValueError, match="rotary_dim"):
        rotary_kv_store(q, k, v, args[0], _cache(32), *args[2:])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_full_size(dtype: torch.dtype) -> None:
    """Qwen3-8B's attention: 32 query heads over 8 kv heads of 128, a prefill's tokens."""
    q, k, v, _ = _case(2048, 32, 8, 128, dtype)
    positions = torch.randint(0, 4096, (2048,), device=DEVICE)
    slots = torch.randperm(4096, device=DEVICE)[:2048]
    slots[::7] = -1
    w = {"q_norm_weight": torch.randn(128, device=DEVICE).to(dtype),
         "k_norm_weight": torch.randn(128, device=DEVICE).to(dtype)}
    caches = [torch.zeros(256, 16, 8, 128, device=DEVICE, dtype=dtype) for _ in range(4)]
    cache = _cache(128, 4096)
    ref_q, ref_k = naive_rotary_kv_store(q, k, v, positions, cache, caches[2], caches[3], slots, **w)
    out_q, out_k = rotary_kv_store(q, k, v, positions, cache, caches[0], caches[1], slots, **w)
    assert_close(out_q, ref_q, tol_for(dtype), "q")
    assert_close(out_k, ref_k, tol_for(dtype), "k")
    assert_close(caches[0], caches[2], tol_for(dtype), "k_cache")
    assert torch.equal(caches[1], caches[3])

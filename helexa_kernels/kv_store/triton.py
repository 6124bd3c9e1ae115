"""KV store in Triton: one program per (token, head tile) copies its k and v rows to their slot.

Slot -1 marks a token without a cache slot (padding in a captured CUDA graph batch): skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kv_store_fwd_kernel(
    k,  # [num_tokens, H, D] (strided)
    v,  # [num_tokens, H, D] (strided)
    k_cache,  # [num_blocks * block_size, H, D]
    v_cache,  # [num_blocks * block_size, H, D]
    slot_mapping,  # [num_tokens]
    stride_kt, stride_kh, stride_vt, stride_vh,
    H, D,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_slot = tl.load(slot_mapping + i_t).to(tl.int64)
    if i_slot < 0:
        return
    o_h = i_h * BLOCK_H + tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    m_hd = (o_h[:, None] < H) & (o_d[None, :] < D)
    b_k = tl.load(k + i_t * stride_kt + o_h[:, None] * stride_kh + o_d[None, :], mask=m_hd)
    b_v = tl.load(v + i_t * stride_vt + o_h[:, None] * stride_vh + o_d[None, :], mask=m_hd)
    p_cache = i_slot * H * D + o_h[:, None] * D + o_d[None, :]  # [BLOCK_H, BLOCK_D]
    tl.store(k_cache + p_cache, b_k.to(k_cache.dtype.element_ty), mask=m_hd)
    tl.store(v_cache + p_cache, b_v.to(v_cache.dtype.element_ty), mask=m_hd)


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into caches
    [num_blocks, block_size, num_kv_heads, head_dim] at flat slots; slot -1 is skipped."""
    num_tokens, H, D = k.shape
    if k_cache.shape[2:] != (H, D) or v_cache.shape != k_cache.shape or v.shape != k.shape:
        raise ValueError("k/v and the caches disagree on kv heads or head_dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("k and v need a contiguous last dim")
    if num_tokens == 0:
        return
    BLOCK_D = triton.next_power_of_2(D)
    BLOCK_H = min(triton.next_power_of_2(H), max(1, 2048 // BLOCK_D))
    kv_store_fwd_kernel[(num_tokens, triton.cdiv(H, BLOCK_H))](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        H, D, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
    )

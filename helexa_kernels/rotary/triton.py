"""Rotate-half RoPE in Triton: one program per token rotates all its q and k heads.

Only the first rotary_dim = cos_sin_cache.shape[-1] dims are touched; the rest stay as they
are, which is what partial rotary (Qwen3-Next/Qwen3.5) needs. Works in place on strided views
(q and k may be slices of a fused qkv projection), so only the last dim must be contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x, stride_h, H, b_cos, b_sin, HALF, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    o_h = tl.arange(0, BLOCK_H)
    o_r = tl.arange(0, BLOCK_HALF)
    m_x = (o_h[:, None] < H) & (o_r[None, :] < HALF)
    p_x1 = x + o_h[:, None] * stride_h + o_r[None, :]  # [BLOCK_H, BLOCK_HALF]
    b_x1 = tl.load(p_x1, mask=m_x, other=0.0).to(tl.float32)
    b_x2 = tl.load(p_x1 + HALF, mask=m_x, other=0.0).to(tl.float32)
    b_o1 = b_x1 * b_cos[None, :] - b_x2 * b_sin[None, :]
    b_o2 = b_x2 * b_cos[None, :] + b_x1 * b_sin[None, :]
    tl.store(p_x1, b_o1.to(x.dtype.element_ty), mask=m_x)
    tl.store(p_x1 + HALF, b_o2.to(x.dtype.element_ty), mask=m_x)


@triton.jit
def rotary_fwd_kernel(
    q,  # [num_tokens, HQ, head_dim], rotated in place
    k,  # [num_tokens, HK, head_dim], rotated in place
    positions,  # [num_tokens]
    cos_sin_cache,  # [max_position, 2 * HALF]
    stride_qt, stride_qh, stride_kt, stride_kh,
    HQ, HK, HALF,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    i_pos = tl.load(positions + i_t).to(tl.int64)
    o_r = tl.arange(0, BLOCK_HALF)
    p_cos = cos_sin_cache + i_pos * 2 * HALF + o_r
    b_cos = tl.load(p_cos, mask=o_r < HALF, other=0.0).to(tl.float32)
    b_sin = tl.load(p_cos + HALF, mask=o_r < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q + i_t * stride_qt, stride_qh, HQ, b_cos, b_sin, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(k + i_t * stride_kt, stride_kh, HK, b_cos, b_sin, HALF, BLOCK_HK, BLOCK_HALF)


def rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
           cos_sin_cache: torch.Tensor, *,
           inplace: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim]
    at `positions` [num_tokens] with cos_sin_cache [max_position, rotary_dim] (cos | sin).

    `inplace` writes into q and k (last dim contiguous) and returns them.
    """
    rotary_dim = cos_sin_cache.shape[-1]
    if rotary_dim % 2 or rotary_dim > q.shape[-1] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"rotary_dim {rotary_dim} does not fit head_dim {q.shape[-1]}")
    if not inplace:
        q, k = q.clone(), k.clone()
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("q and k need a contiguous last dim")
    num_tokens, HQ, _ = q.shape
    HK = k.shape[1]
    if num_tokens:
        rotary_fwd_kernel[(num_tokens,)](
            q, k, positions, cos_sin_cache.contiguous(), q.stride(0), q.stride(1), k.stride(0),
            k.stride(1), HQ, HK, rotary_dim // 2, BLOCK_HQ=triton.next_power_of_2(HQ),
            BLOCK_HK=triton.next_power_of_2(HK), BLOCK_HALF=triton.next_power_of_2(rotary_dim // 2),
        )
    return q, k

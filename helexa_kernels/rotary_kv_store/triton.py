"""The attention prologue in Triton: per-head q/k RMSNorm, RoPE and the KV store in one kernel.

A decode step ran these as four launches per layer (q norm, k norm, rotary, KV store), each
a couple of microseconds of mostly launch latency at batch 1; here one program per (token, kv
head) reads that kv head's GROUP query heads, its key head and its value head once, normalizes
and rotates q and k in place (they may be strided views of the packed qkv projection) and
writes the rotated key and the value to the token's cache slot (-1: none, as for a CUDA graph's
padding rows). The norm's output is rounded to q's dtype before the rotation reads it, as the
separate ops do, so the fused and unfused paths agree to the last rounding.

The rotation pairs dim d with d + rotary_dim / 2: each program loads its heads twice, once at
d and once at the partner dim, rather than splitting the tile in halves, so partial rotary
(dims past rotary_dim pass through) needs no other code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rotate(x, stride_h, w, eps, b_cos, b_sin, o_d, o_pair, m_d, m_rot,
                 H: tl.constexpr, D: tl.constexpr, HAS_NORM: tl.constexpr,
                 UNIT_OFFSET: tl.constexpr, BLOCK_H: tl.constexpr):
    """H heads at x, stride_h apart: normalized, rotated and stored back; returns them
    [BLOCK_H, BLOCK_D] in x's dtype."""
    o_h = tl.arange(0, BLOCK_H)
    m_x = (o_h < H)[:, None] & m_d[None, :]
    p_x = x + o_h[:, None] * stride_h  # [BLOCK_H, 1]
    b_x = tl.load(p_x + o_d[None, :], mask=m_x, other=0.0).to(tl.float32)  # [BLOCK_H, BLOCK_D]
    b_xp = tl.load(p_x + o_pair[None, :], mask=m_x & m_rot[None, :], other=0.0).to(tl.float32)
    if HAS_NORM:
        b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)[:, None]  # [BLOCK_H, 1]
        b_w = tl.load(w + o_d, mask=m_d, other=0.0).to(tl.float32)
        b_wp = tl.load(w + o_pair, mask=m_rot, other=0.0).to(tl.float32)
        if UNIT_OFFSET:
            b_w = b_w + 1.0
            b_wp = b_wp + 1.0
        b_x = (b_x * b_rstd * b_w[None, :]).to(x.dtype.element_ty).to(tl.float32)
        b_xp = (b_xp * b_rstd * b_wp[None, :]).to(x.dtype.element_ty).to(tl.float32)
    b_o = tl.where(m_rot[None, :], b_x * b_cos[None, :] + b_xp * b_sin[None, :], b_x)
    b_o = b_o.to(x.dtype.element_ty)
    tl.store(p_x + o_d[None, :], b_o, mask=m_x)
    return b_o


@triton.jit
def rotary_kv_store_fwd_kernel(
    q,  # [num_tokens, HK * GROUP, D] (strided), normalized and rotated in place
    k,  # [num_tokens, HK, D] (strided), normalized and rotated in place
    v,  # [num_tokens, HK, D] (strided)
    positions,  # [num_tokens]
    cos_sin_cache,  # [max_position, 2 * HALF]: cos | sin
    k_cache,  # [num_blocks * block_size, HK, D]
    v_cache,  # [num_blocks * block_size, HK, D]
    slot_mapping,  # [num_tokens], -1: no slot
    q_norm_weight,  # [D] (HAS_NORM)
    k_norm_weight,  # [D] (HAS_NORM)
    eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    HK, HALF,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_t, i_hk = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_pos = tl.load(positions + i_t).to(tl.int64)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    m_rot = o_d < 2 * HALF
    o_half = tl.where(o_d < HALF, o_d, o_d - HALF)  # [BLOCK_D] frequency of each dim's pair
    o_pair = tl.where(o_d < HALF, o_d + HALF, o_d - HALF)
    p_cs = cos_sin_cache + i_pos * 2 * HALF + o_half
    b_cos = tl.load(p_cs, mask=m_rot, other=1.0).to(tl.float32)
    b_sin = tl.load(p_cs + HALF, mask=m_rot, other=0.0).to(tl.float32)
    # First half: x1 cos - x2 sin; second half: x2 cos + x1 sin.
    b_sin = tl.where(o_d < HALF, -b_sin, b_sin)

    _norm_rotate(q + i_t * stride_qt + i_hk * GROUP * stride_qh, stride_qh, q_norm_weight, eps,
                 b_cos, b_sin, o_d, o_pair, m_d, m_rot, GROUP, D, HAS_NORM, UNIT_OFFSET, BLOCK_G)
    b_k = _norm_rotate(k + i_t * stride_kt + i_hk * stride_kh, 0, k_norm_weight, eps,
                       b_cos, b_sin, o_d, o_pair, m_d, m_rot, 1, D, HAS_NORM, UNIT_OFFSET, 1)

    i_slot = tl.load(slot_mapping + i_t).to(tl.int64)
    m_store = m_d & (i_slot >= 0)
    b_v = tl.load(v + i_t * stride_vt + i_hk * stride_vh + o_d, mask=m_store, other=0.0)
    p_cache = i_slot * HK * D + i_hk * D + o_d  # [BLOCK_D]
    tl.store(k_cache + p_cache[None, :], b_k.to(k_cache.dtype.element_ty), mask=m_store[None, :])
    tl.store(v_cache + p_cache, b_v.to(v_cache.dtype.element_ty), mask=m_store)


def rotary_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                    cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor, q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                    unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim]
    normalized per head (when given their [head_dim] weights) and rotated at `positions` with
    cos_sin_cache [max_position, rotary_dim]; k and v [num_tokens, num_kv_heads, head_dim] then
    written to the caches [num_blocks, block_size, num_kv_heads, head_dim] at `slot_mapping`.
    q, k, v need a contiguous last dim only. Returns (q, k)."""
    num_tokens, H, D = q.shape
    HK = k.shape[1]
    rotary_dim = cos_sin_cache.shape[-1]
    if H % HK or k.shape != (num_tokens, HK, D) or v.shape != k.shape:
        raise ValueError("q [T, H, D], k and v [T, HK, D] with H a multiple of HK")
    if k_cache.shape[2:] != (HK, D) or v_cache.shape != k_cache.shape:
        raise ValueError("the caches disagree with k/v on kv heads or head_dim")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("caches must be contiguous")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k and v need a contiguous last dim")
    if rotary_dim % 2 or rotary_dim > D:
        raise ValueError(f"rotary_dim {rotary_dim} does not fit head_dim {D}")
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q and k are normalized together or not at all")
    has_norm = q_norm_weight is not None
    if has_norm and (q_norm_weight.shape != (D,) or k_norm_weight.shape != (D,)):
        raise ValueError(f"norm weights must be [{D}]")
    if num_tokens:
        group = H // HK
        rotary_kv_store_fwd_kernel[(num_tokens, HK)](
            q, k, v, positions, cos_sin_cache.contiguous(), k_cache, v_cache, slot_mapping,
            q_norm_weight if has_norm else q, k_norm_weight if has_norm else k, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            HK, rotary_dim // 2, D=D, GROUP=group, HAS_NORM=has_norm, UNIT_OFFSET=unit_offset,
            BLOCK_G=triton.next_power_of_2(group), BLOCK_D=triton.next_power_of_2(D), num_warps=4,
        )
    return q, k

"""The gated delta rule in Triton: recurrent (decode) and chunked (prefill), on state slots.

Both kernels here give one program a (sequence, value head, V tile): it holds its [K, BV] slice
of the fp32 state in registers from the slot it reads to the slot it writes, and walks the
sequence's tokens in order. The recurrent kernel takes a token per step; the inline chunked
kernel takes BT tokens per step and turns the chunk's sequential updates into dot products by
solving the chunk's unit lower triangular system (see naive.py for the algebra): it inverts
(I + L) by forward substitution over the BT rows (independent of V), then applies it with one
dot. The default chunked form, `triton_chunk.py`, solves every chunk's system in a parallel
first pass instead (8.6 ms for the inline kernel against fla-core's 1.18 ms on an H200, 4 x 2048
tokens, 32 value heads of 128).

Layouts (flat tokens, as the engine lays out a step): q, k [num_tokens, HK, K],
v [num_tokens, HV, V], g, beta [num_tokens, HV], state [num_slots, HV, K, V] fp32.
L2 normalization of q, k (eps 1e-6) and the q scale happen inside the kernels.

Untuned: no GPU has timed these yet. At K = V = 128 the chunked kernel needs 255 registers
and spills about 1.3 KB per thread on sm_90 (tests/kernels/compile_sm90.py), and its
parallelism is sequences x heads x V tiles, with chunks in order inside a program.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from helexa_kernels.gated_delta_rule import triton_chunk
from helexa_kernels.utils import dot_args, interpreting


@triton.jit
def recurrent_gated_delta_rule_fwd_kernel(
    q, k, v, g, beta, o,
    state,  # [num_slots, HV, K, V] fp32
    state_indices,  # [num_seqs]
    cu_seqlens,  # [num_seqs + 1] (IS_VARLEN)
    has_initial_state,  # [num_seqs] (HAS_INIT_FLAGS)
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    HK, HV, K, V,
    IS_VARLEN: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if i_slot < 0:
        return
    if IS_VARLEN:
        bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos, eos = i_n.to(tl.int64), i_n.to(tl.int64) + 1

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + (i_slot * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]  # [BK, BV]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    if HAS_INIT_FLAGS:
        # A fresh sequence ignores whatever its slot holds (where, not a product: it may be NaN).
        b_s = tl.where(tl.load(has_initial_state + i_n) != 0, b_s, 0.0)

    for i_t in range(bos, eos):
        b_q = tl.load(q + i_t * stride_qt + i_hk * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + i_t * stride_kt + i_hk * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + i_t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + i_t * HV + i_h).to(tl.float32)
        b_beta = tl.load(beta + i_t * HV + i_h).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=0) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=0) + 1e-6)
        b_q = b_q * scale
        b_s = b_s * tl.exp(b_g)
        b_delta = b_beta * (b_v - tl.sum(b_s * b_k[:, None], axis=0))  # [BV]
        b_s = b_s + b_k[:, None] * b_delta[None, :]
        b_o = tl.sum(b_s * b_q[:, None], axis=0)  # [BV]
        tl.store(o + i_t * V * HV + i_h * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(p_s, b_s, mask=m_s)


@triton.jit
def chunk_gated_delta_rule_fwd_kernel(
    q, k, v, g, beta, o,
    state,  # [num_slots, HV, K, V] fp32
    state_indices,  # [num_seqs]
    cu_seqlens,  # [num_seqs + 1]
    has_initial_state,  # [num_seqs] (HAS_INIT_FLAGS)
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    HK, HV, K, V,
    HAS_INIT_FLAGS: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_hk = i_h // (HV // HK)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if i_slot < 0:
        return
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = state + (i_slot * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]  # [BK, BV]
    b_s = tl.load(p_s, mask=m_s, other=0.0).to(tl.float32)
    if HAS_INIT_FLAGS:
        # A fresh sequence ignores whatever its slot holds (where, not a product: it may be NaN).
        b_s = tl.where(tl.load(has_initial_state + i_n) != 0, b_s, 0.0)
    m_causal = o_t[:, None] >= o_t[None, :]  # [BT, BT]
    m_strict = o_t[:, None] > o_t[None, :]
    b_eye = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)

    for i_start in range(bos, eos, BT):
        i_tok = i_start + o_t  # [BT]
        m_t = i_tok < eos
        p_q = q + i_tok[:, None] * stride_qt + i_hk * stride_qh + o_k[None, :]
        p_k = k + i_tok[:, None] * stride_kt + i_hk * stride_kh + o_k[None, :]
        p_v = v + i_tok[:, None] * stride_vt + i_h * stride_vh + o_v[None, :]
        b_q = tl.load(p_q, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BT, BK]
        b_k = tl.load(p_k, mask=m_t[:, None] & m_k[None, :], other=0.0).to(tl.float32)  # [BT, BK]
        b_v = tl.load(p_v, mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)  # [BT, BV]
        # Padding rows get g = 0 and beta = 0: no decay, no update, so the chunk's last
        # cumulative decay is that of its last real token.
        b_g = tl.load(g + i_tok * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + i_tok * HV + i_h, mask=m_t, other=0.0).to(tl.float32)
        if USE_QK_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
        b_q = b_q * scale

        b_gc = tl.cumsum(b_g, axis=0)  # [BT] inclusive cumulative log-decay
        b_g_last = tl.sum(tl.where(o_t == BT - 1, b_gc, 0.0), axis=0)
        # exp(G_i - G_j) on and below the diagonal; -inf above keeps it from overflowing.
        b_decay = tl.exp(tl.where(m_causal, b_gc[:, None] - b_gc[None, :], float("-inf")))
        b_kt = tl.trans(b_k)  # [BK, BT]
        b_kk = tl.dot(b_k, b_kt, input_precision=PRECISION)  # [BT, BT]
        b_L = tl.where(m_strict, b_beta[:, None] * b_kk * b_decay, 0.0)

        # T = (I + L)^-1, a row at a time: T_i = e_i - sum_{j<i} L_ij T_j.
        b_T = b_eye
        for i in range(1, BT):
            b_L_i = tl.sum(tl.where(o_t[:, None] == i, b_L, 0.0), axis=0)  # [BT] row i of L
            b_LT_i = tl.sum(b_L_i[:, None] * b_T, axis=0)  # [BT]
            b_T = tl.where(o_t[:, None] == i, b_T - b_LT_i[None, :], b_T)

        b_eg = tl.exp(b_gc)
        b_ks = tl.dot(b_k, b_s, input_precision=PRECISION)  # [BT, BV]
        b_rhs = b_beta[:, None] * (b_v - b_eg[:, None] * b_ks)
        b_delta = tl.dot(b_T, b_rhs, input_precision=PRECISION)  # [BT, BV]

        b_qk = tl.dot(b_q, b_kt, input_precision=PRECISION) * b_decay  # [BT, BT]
        b_o = (b_eg[:, None] * tl.dot(b_q, b_s, input_precision=PRECISION)
               + tl.dot(b_qk, b_delta, input_precision=PRECISION))  # [BT, BV]
        p_o = o + i_tok[:, None] * V * HV + i_h * V + o_v[None, :]
        tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_t[:, None] & m_v[None, :])

        b_kd = tl.trans(b_k * tl.exp(b_g_last - b_gc)[:, None])  # [BK, BT]
        b_s = b_s * tl.exp(b_g_last) + tl.dot(b_kd, b_delta, input_precision=PRECISION)
    tl.store(p_s, b_s, mask=m_s)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor, state: torch.Tensor) -> None:
    T, HK, K = q.shape
    HV, V = v.shape[1], v.shape[2]
    if k.shape != q.shape or v.shape[0] != T or HV % HK:
        raise ValueError("q, k [T, HK, K] and v [T, HV, V] with HV a multiple of HK")
    if g.shape != (T, HV) or beta.shape != (T, HV):
        raise ValueError("g and beta must be [num_tokens, HV]")
    if state.dtype != torch.float32 or state.shape[1:] != (HV, K, V) or not state.is_contiguous():
        raise ValueError("state must be contiguous fp32 [num_slots, HV, K, V]")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("q, k, v need a contiguous last dim")


def _flags(has_initial_state: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    # As int32: bool pointers load as i1, which masks do not mix with everywhere.
    return has_initial_state.to(torch.int32) if has_initial_state is not None else fallback


def recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
    scale: float | None = None, use_qk_l2norm: bool = True,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """Token-by-token gated delta rule; `cu_seqlens` None means one token per sequence (decode).

    q, k [num_tokens, HK, K]; v [num_tokens, HV, V]; g, beta [num_tokens, HV]; state
    [num_slots, HV, K, V] fp32, read at and written back to state_indices [num_seqs] (-1: skip)
    -> o [num_tokens, HV, V] in v's dtype.
    """
    _check(q, k, v, g, beta, state)
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    num_seqs = state_indices.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is None and num_seqs != T:
        raise ValueError("without cu_seqlens, state_indices needs one slot per token")
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    BK, BV = triton.next_power_of_2(K), min(triton.next_power_of_2(V), 32)
    recurrent_gated_delta_rule_fwd_kernel[(triton.cdiv(V, BV), num_seqs * HV)](
        q, k, v, g.contiguous(), beta.contiguous(), o, state, state_indices,
        cu_seqlens if cu_seqlens is not None else state_indices,
        _flags(has_initial_state, state_indices),
        scale if scale is not None else K ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HK, HV, K, V, IS_VARLEN=cu_seqlens is not None,
        HAS_INIT_FLAGS=has_initial_state is not None, USE_QK_L2NORM=use_qk_l2norm,
        BK=BK, BV=BV, num_warps=4,
    )
    return o


# The chunked forms: "wy" (triton_chunk.py, two passes) and "inline" (the single kernel below).
# `chunk_gated_delta_rule` runs HELEXA_GDN_CHUNK's where it is set, else wy for 16-bit inputs and
# inline for fp32 ones on a GPU: the wy kernels' exact fp32 dots spill ~10 KB per thread on sm_90
# (tests/kernels/compile_sm90.py), where its bf16 ones fit.
CHUNK_FORMS = ("wy", "inline")


def _default_form(dtype: torch.dtype) -> str:
    form = os.environ.get("HELEXA_GDN_CHUNK")
    if form:
        return form
    return "inline" if dtype == torch.float32 and not interpreting() else "wy"


def chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, *,
    scale: float | None = None, use_qk_l2norm: bool = True,
    has_initial_state: torch.Tensor | None = None, chunk_size: int = 64,
    block_v: int | None = None, form: str | None = None,
) -> torch.Tensor:
    """Chunked gated delta rule for prefill; same contract as `recurrent_gated_delta_rule`,
    with cu_seqlens [num_seqs + 1] required and sequences of any length. `form`: "wy" (chunks
    of 64 only) or "inline"; default HELEXA_GDN_CHUNK, else `_default_form`. `block_v`: the state's V tile
    per program (default 64 for wy, 32 for inline)."""
    form = form or _default_form(q.dtype)
    if form not in CHUNK_FORMS:
        raise ValueError(f"form must be one of {', '.join(CHUNK_FORMS)}, got {form!r}")
    if form == "inline":
        return chunk_gated_delta_rule_inline(
            q, k, v, g, beta, state, state_indices, cu_seqlens, scale=scale,
            use_qk_l2norm=use_qk_l2norm, has_initial_state=has_initial_state,
            chunk_size=chunk_size, block_v=block_v or 32)
    if chunk_size != triton_chunk.CHUNK:
        raise ValueError(f"the wy form takes chunks of {triton_chunk.CHUNK} tokens")
    _check(q, k, v, g, beta, state)
    return triton_chunk.chunk_gated_delta_rule_wy(
        q, k, v, g, beta, state, state_indices, cu_seqlens,
        scale=scale if scale is not None else q.shape[-1] ** -0.5, use_qk_l2norm=use_qk_l2norm,
        has_initial_state=_flags(has_initial_state, state_indices),
        has_init_flags=has_initial_state is not None, block_v=block_v or 64)


def chunk_gated_delta_rule_inline(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, *,
    scale: float | None = None, use_qk_l2norm: bool = True,
    has_initial_state: torch.Tensor | None = None, chunk_size: int = 64, block_v: int = 32,
) -> torch.Tensor:
    """The single-kernel chunked form: each chunk's system solved inside the sequential walk."""
    _check(q, k, v, g, beta, state)
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    BK, BV = max(16, triton.next_power_of_2(K)), max(16, min(triton.next_power_of_2(V), block_v))
    chunk_gated_delta_rule_fwd_kernel[(triton.cdiv(V, BV), num_seqs * HV)](
        q, k, v, g.contiguous(), beta.contiguous(), o, state, state_indices, cu_seqlens,
        _flags(has_initial_state, state_indices),
        scale if scale is not None else K ** -0.5,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        HK, HV, K, V, HAS_INIT_FLAGS=has_initial_state is not None,
        USE_QK_L2NORM=use_qk_l2norm, BT=chunk_size, BK=BK, BV=BV,
        PRECISION=dot_args(q.dtype)["PRECISION"], num_warps=8,
    )
    return o

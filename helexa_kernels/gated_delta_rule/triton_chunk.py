"""The gated delta rule's chunked prefill in Triton, in two passes: chunks in parallel, then the state.

The single-kernel form (`triton.chunk_gated_delta_rule_inline`) solves each chunk's triangular
system inside the sequential walk over the chunks, by a 64-step forward substitution over
[64, 64] tiles, once per V tile: its critical path is O(chunks x 64 x 64^2) per program. Here
everything that does not depend on the state moves to a first kernel that runs every (chunk,
value head) at once, and the sequential kernel is left with four dot products per chunk.

Per chunk (C = 64 tokens, inclusive cumulative log-decay G, A_ij = beta_i exp(G_i - G_j) k_i.k_j
for j < i, T = (I + A)^-1; see naive.py), with the state S0 at the chunk's start:

    delta = T beta (v - exp(G) K S0) = u - w S0,  u = T (beta v),  w = T (beta exp(G) K)
    o = exp(G) (Q S0) + Aqk delta,  Aqk = [(Q K^T) exp(G_i - G_j)]_{j <= i}
    S_end = exp(G_C) S0 + (K exp(G_C - G))^T delta

`chunk_gated_delta_rule_wy_prepare_fwd_kernel` (grid: chunks x value heads) computes G, w, u and
Aqk. It inverts (I + A) in four 16-row blocks: each diagonal block by a 16-step substitution,
the blocks below it with [16, 16] dot products (T_ij = -T_ii sum_{j<=m<i} A_im T_mj).
`chunk_gated_delta_rule_wy_fwd_kernel` (grid: V tiles x sequences x value heads) then walks a
sequence's chunks in order, holding its [K, BV] slice of the fp32 state in registers.

Chunks start at each sequence's first token; the chunk -> sequence map is built on the device
(no host sync), over an upper bound of the chunk count, and programs past the last chunk exit.
Layouts, the state slots and has_initial_state are those of `triton.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from helexa_kernels.utils import dot_args

CHUNK = 64  # tokens per chunk: four blocks of BLOCK_C for the inversion
BLOCK_C = 16


@triton.jit
def _load_rows(q, k, g, beta, row, num_rows, i_hk, i_h, scale, stride_qt, stride_qh, stride_kt,
               stride_kh, HV, K, USE_QK_L2NORM: tl.constexpr, BR: tl.constexpr,
               BK: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """BR rows of one head from token `row` on: q (normalized, scaled) and k (normalized) as dot
    operands, g and beta in fp32; rows past the first num_rows are zeros (no decay, no update).
    Offsets are int32 from a scalar base: int64 ones would hold a 64-bit address per element."""
    o_r = tl.arange(0, BR)
    o_k = tl.arange(0, BK)
    m_r = o_r < num_rows
    m_rk = m_r[:, None] & (o_k < K)[None, :]
    p_q = q + row * stride_qt + i_hk * stride_qh
    p_k = k + row * stride_kt + i_hk * stride_kh
    b_q = tl.load(p_q + o_r[:, None] * stride_qt + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
    b_k = tl.load(p_k + o_r[:, None] * stride_kt + o_k[None, :], mask=m_rk, other=0.0).to(tl.float32)
    b_g = tl.load(g + row * HV + i_h + o_r * HV, mask=m_r, other=0.0).to(tl.float32)
    b_beta = tl.load(beta + row * HV + i_h + o_r * HV, mask=m_r, other=0.0).to(tl.float32)
    if USE_QK_L2NORM:
        b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, axis=1) + 1e-6)[:, None]
        b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, axis=1) + 1e-6)[:, None]
    return (b_q * scale).to(DOT_DTYPE), b_k.to(DOT_DTYPE), b_g, b_beta


@triton.jit
def _beta_v(v, b_beta, row, num_rows, i_h, stride_vt, stride_vh, V, BR: tl.constexpr,
            BV: tl.constexpr, DOT_DTYPE: tl.constexpr):
    """beta * v over BR rows of value head i_h from token `row` on, as a dot operand."""
    o_r = tl.arange(0, BR)
    o_v = tl.arange(0, BV)
    p_v = v + row * stride_vt + i_h * stride_vh
    b_v = tl.load(p_v + o_r[:, None] * stride_vt + o_v[None, :],
                  mask=(o_r < num_rows)[:, None] & (o_v < V)[None, :], other=0.0).to(tl.float32)
    return (b_beta[:, None] * b_v).to(DOT_DTYPE)


@triton.jit
def _decay(b_gc_i, b_gc_j, DIAG: tl.constexpr, STRICT: tl.constexpr, BC: tl.constexpr):
    """exp(G_i - G_j) over one [BC, BC] block; a diagonal block keeps only what is below the
    diagonal (STRICT) or on and below it, 0 elsewhere (-inf exponents: no overflow)."""
    b_diff = b_gc_i[:, None] - b_gc_j[None, :]
    if DIAG:
        o_c = tl.arange(0, BC)
        if STRICT:
            b_diff = tl.where(o_c[:, None] > o_c[None, :], b_diff, float("-inf"))
        else:
            b_diff = tl.where(o_c[:, None] >= o_c[None, :], b_diff, float("-inf"))
    return tl.exp(b_diff)


@triton.jit
def _kk(b_ki, b_kj, b_beta_i, b_gc_i, b_gc_j, DIAG: tl.constexpr, BC: tl.constexpr,
        PRECISION: tl.constexpr):
    """Block (i, j) of A = beta_i exp(G_i - G_j) k_i.k_j, strictly lower on the diagonal."""
    b_kk = tl.dot(b_ki, tl.trans(b_kj), input_precision=PRECISION)
    return b_beta_i[:, None] * b_kk * _decay(b_gc_i, b_gc_j, DIAG, True, BC)


@triton.jit
def _qk(b_qi, b_kj, b_gc_i, b_gc_j, DIAG: tl.constexpr, BC: tl.constexpr,
        PRECISION: tl.constexpr):
    """Block (i, j) of Aqk = exp(G_i - G_j) q_i.k_j, on and below the diagonal."""
    b_qk = tl.dot(b_qi, tl.trans(b_kj), input_precision=PRECISION)
    return b_qk * _decay(b_gc_i, b_gc_j, DIAG, False, BC)


@triton.jit
def _substitute_row(b_A, b_T, i, BC: tl.constexpr):
    """Row i of (I + A)^-1 from the rows above it: T_i = e_i - sum_{j<i} A_ij T_j."""
    o_c = tl.arange(0, BC)
    b_a = tl.sum(tl.where(o_c[:, None] == i, b_A, 0.0), axis=0)  # [BC] row i of A
    b_t = tl.sum(b_a[:, None] * b_T, axis=0)  # [BC]
    return tl.where(o_c[:, None] == i, b_T - b_t[None, :], b_T)


@triton.jit
def _store_rows(p, b_x, row, num_rows, i_h, HV, W, BR: tl.constexpr, BW: tl.constexpr):
    """BR rows (the first num_rows of them) of a [num_tokens, HV, W] buffer from token `row` on,
    for value head i_h."""
    o_r = tl.arange(0, BR)
    o_w = tl.arange(0, BW)
    p_x = p + (row * HV + i_h) * W + o_r[:, None] * (HV * W) + o_w[None, :]
    tl.store(p_x, b_x.to(p.dtype.element_ty), mask=(o_r < num_rows)[:, None] & (o_w < W)[None, :])


@triton.jit
def chunk_gated_delta_rule_wy_prepare_fwd_kernel(
    q, k, v, g, beta,
    gc,  # [num_tokens, HV] fp32: inclusive cumulative log-decay within the chunk
    w,  # [num_tokens, HV, K]
    u,  # [num_tokens, HV, V]
    aqk,  # [num_tokens, HV, CHUNK]: row i's Aqk over its chunk's tokens
    cu_seqlens,  # [num_seqs + 1]
    chunk_seqs,  # [max_chunks]: the sequence of each chunk, num_seqs past the last
    cu_chunks,  # [num_seqs + 1]: each sequence's first chunk
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
    num_seqs, HK, HV, K, V,
    USE_QK_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_c, i_h = tl.program_id(0), tl.program_id(1)
    i_n = tl.load(chunk_seqs + i_c)
    if i_n >= num_seqs:
        return
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    start = bos + (i_c - tl.load(cu_chunks + i_n)).to(tl.int64) * BT
    i_hk = i_h // (HV // HK)
    o_c = tl.arange(0, BC)
    # Each block's first token, and how many of its rows are real.
    r_0, r_1, r_2, r_3 = start, start + BC, start + 2 * BC, start + 3 * BC
    n_0, n_1, n_2, n_3 = eos - r_0, eos - r_1, eos - r_2, eos - r_3

    b_q0, b_k0, b_g0, b_beta0 = _load_rows(
        q, k, g, beta, r_0, n_0, i_hk, i_h, scale, stride_qt, stride_qh, stride_kt, stride_kh,
        HV, K, USE_QK_L2NORM, BC, BK, DOT_DTYPE)
    b_q1, b_k1, b_g1, b_beta1 = _load_rows(
        q, k, g, beta, r_1, n_1, i_hk, i_h, scale, stride_qt, stride_qh, stride_kt, stride_kh,
        HV, K, USE_QK_L2NORM, BC, BK, DOT_DTYPE)
    b_q2, b_k2, b_g2, b_beta2 = _load_rows(
        q, k, g, beta, r_2, n_2, i_hk, i_h, scale, stride_qt, stride_qh, stride_kt, stride_kh,
        HV, K, USE_QK_L2NORM, BC, BK, DOT_DTYPE)
    b_q3, b_k3, b_g3, b_beta3 = _load_rows(
        q, k, g, beta, r_3, n_3, i_hk, i_h, scale, stride_qt, stride_qh, stride_kt, stride_kh,
        HV, K, USE_QK_L2NORM, BC, BK, DOT_DTYPE)
    # Inclusive cumulative decay over the whole chunk, block by block.
    b_gc0 = tl.cumsum(b_g0, axis=0)
    b_gc1 = tl.cumsum(b_g1, axis=0) + tl.sum(b_g0, axis=0)
    b_gc2 = tl.cumsum(b_g2, axis=0) + tl.sum(b_g0, axis=0) + tl.sum(b_g1, axis=0)
    b_gc3 = tl.cumsum(b_g3, axis=0) + tl.sum(b_g0, axis=0) + tl.sum(b_g1, axis=0) + tl.sum(b_g2, axis=0)
    p_gc = gc + i_h
    tl.store(p_gc + (r_0 + o_c) * HV, b_gc0, mask=o_c < n_0)
    tl.store(p_gc + (r_1 + o_c) * HV, b_gc1, mask=o_c < n_1)
    tl.store(p_gc + (r_2 + o_c) * HV, b_gc2, mask=o_c < n_2)
    tl.store(p_gc + (r_3 + o_c) * HV, b_gc3, mask=o_c < n_3)

    # Aqk, one row block at a time (zeros above the diagonal): q is not needed after this.
    b_zero = tl.zeros([BC, BC], dtype=tl.float32)
    _store_rows(aqk, _qk(b_q0, b_k0, b_gc0, b_gc0, True, BC, PRECISION), r_0, n_0, i_h, HV, BT, BC, BC)
    _store_rows(aqk + BC, b_zero, r_0, n_0, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 2 * BC, b_zero, r_0, n_0, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 3 * BC, b_zero, r_0, n_0, i_h, HV, BT, BC, BC)
    _store_rows(aqk, _qk(b_q1, b_k0, b_gc1, b_gc0, False, BC, PRECISION), r_1, n_1, i_h, HV, BT, BC, BC)
    _store_rows(aqk + BC, _qk(b_q1, b_k1, b_gc1, b_gc1, True, BC, PRECISION),
                r_1, n_1, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 2 * BC, b_zero, r_1, n_1, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 3 * BC, b_zero, r_1, n_1, i_h, HV, BT, BC, BC)
    _store_rows(aqk, _qk(b_q2, b_k0, b_gc2, b_gc0, False, BC, PRECISION), r_2, n_2, i_h, HV, BT, BC, BC)
    _store_rows(aqk + BC, _qk(b_q2, b_k1, b_gc2, b_gc1, False, BC, PRECISION),
                r_2, n_2, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 2 * BC, _qk(b_q2, b_k2, b_gc2, b_gc2, True, BC, PRECISION),
                r_2, n_2, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 3 * BC, b_zero, r_2, n_2, i_h, HV, BT, BC, BC)
    _store_rows(aqk, _qk(b_q3, b_k0, b_gc3, b_gc0, False, BC, PRECISION), r_3, n_3, i_h, HV, BT, BC, BC)
    _store_rows(aqk + BC, _qk(b_q3, b_k1, b_gc3, b_gc1, False, BC, PRECISION),
                r_3, n_3, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 2 * BC, _qk(b_q3, b_k2, b_gc3, b_gc2, False, BC, PRECISION),
                r_3, n_3, i_h, HV, BT, BC, BC)
    _store_rows(aqk + 3 * BC, _qk(b_q3, b_k3, b_gc3, b_gc3, True, BC, PRECISION),
                r_3, n_3, i_h, HV, BT, BC, BC)

    # A's blocks on and below the diagonal.
    b_A00 = _kk(b_k0, b_k0, b_beta0, b_gc0, b_gc0, True, BC, PRECISION)
    b_A10 = _kk(b_k1, b_k0, b_beta1, b_gc1, b_gc0, False, BC, PRECISION)
    b_A11 = _kk(b_k1, b_k1, b_beta1, b_gc1, b_gc1, True, BC, PRECISION)
    b_A20 = _kk(b_k2, b_k0, b_beta2, b_gc2, b_gc0, False, BC, PRECISION)
    b_A21 = _kk(b_k2, b_k1, b_beta2, b_gc2, b_gc1, False, BC, PRECISION)
    b_A22 = _kk(b_k2, b_k2, b_beta2, b_gc2, b_gc2, True, BC, PRECISION)
    b_A30 = _kk(b_k3, b_k0, b_beta3, b_gc3, b_gc0, False, BC, PRECISION)
    b_A31 = _kk(b_k3, b_k1, b_beta3, b_gc3, b_gc1, False, BC, PRECISION)
    b_A32 = _kk(b_k3, b_k2, b_beta3, b_gc3, b_gc2, False, BC, PRECISION)
    b_A33 = _kk(b_k3, b_k3, b_beta3, b_gc3, b_gc3, True, BC, PRECISION)

    # (I + A)^-1: the diagonal blocks by substitution, all four in one loop ...
    b_eye = tl.where(o_c[:, None] == o_c[None, :], 1.0, 0.0)
    b_T00, b_T11, b_T22, b_T33 = b_eye, b_eye, b_eye, b_eye
    for i in range(1, BC):
        b_T00 = _substitute_row(b_A00, b_T00, i, BC)
        b_T11 = _substitute_row(b_A11, b_T11, i, BC)
        b_T22 = _substitute_row(b_A22, b_T22, i, BC)
        b_T33 = _substitute_row(b_A33, b_T33, i, BC)
    # ... then the blocks below them, a block row at a time.
    b_T10 = -tl.dot(b_T11, tl.dot(b_A10, b_T00, input_precision=PRECISION),
                    input_precision=PRECISION)
    b_T21 = -tl.dot(b_T22, tl.dot(b_A21, b_T11, input_precision=PRECISION),
                    input_precision=PRECISION)
    b_T20 = -tl.dot(b_T22, tl.dot(b_A20, b_T00, input_precision=PRECISION)
                    + tl.dot(b_A21, b_T10, input_precision=PRECISION), input_precision=PRECISION)
    b_T32 = -tl.dot(b_T33, tl.dot(b_A32, b_T22, input_precision=PRECISION),
                    input_precision=PRECISION)
    b_T31 = -tl.dot(b_T33, tl.dot(b_A31, b_T11, input_precision=PRECISION)
                    + tl.dot(b_A32, b_T21, input_precision=PRECISION), input_precision=PRECISION)
    b_T30 = -tl.dot(b_T33, tl.dot(b_A30, b_T00, input_precision=PRECISION)
                    + tl.dot(b_A31, b_T10, input_precision=PRECISION)
                    + tl.dot(b_A32, b_T20, input_precision=PRECISION), input_precision=PRECISION)

    # w = T (beta exp(G) k), u = T (beta v), a row block at a time, on dot operands.
    b_T00, b_T10, b_T11 = b_T00.to(DOT_DTYPE), b_T10.to(DOT_DTYPE), b_T11.to(DOT_DTYPE)
    b_T20, b_T21, b_T22 = b_T20.to(DOT_DTYPE), b_T21.to(DOT_DTYPE), b_T22.to(DOT_DTYPE)
    b_T30, b_T31 = b_T30.to(DOT_DTYPE), b_T31.to(DOT_DTYPE)
    b_T32, b_T33 = b_T32.to(DOT_DTYPE), b_T33.to(DOT_DTYPE)
    b_x0 = ((b_beta0 * tl.exp(b_gc0))[:, None] * b_k0.to(tl.float32)).to(DOT_DTYPE)
    b_x1 = ((b_beta1 * tl.exp(b_gc1))[:, None] * b_k1.to(tl.float32)).to(DOT_DTYPE)
    b_x2 = ((b_beta2 * tl.exp(b_gc2))[:, None] * b_k2.to(tl.float32)).to(DOT_DTYPE)
    b_x3 = ((b_beta3 * tl.exp(b_gc3))[:, None] * b_k3.to(tl.float32)).to(DOT_DTYPE)
    _store_rows(w, tl.dot(b_T00, b_x0, input_precision=PRECISION), r_0, n_0, i_h, HV, K, BC, BK)
    _store_rows(w, tl.dot(b_T10, b_x0, input_precision=PRECISION)
                + tl.dot(b_T11, b_x1, input_precision=PRECISION), r_1, n_1, i_h, HV, K, BC, BK)
    _store_rows(w, tl.dot(b_T20, b_x0, input_precision=PRECISION)
                + tl.dot(b_T21, b_x1, input_precision=PRECISION)
                + tl.dot(b_T22, b_x2, input_precision=PRECISION), r_2, n_2, i_h, HV, K, BC, BK)
    _store_rows(w, tl.dot(b_T30, b_x0, input_precision=PRECISION)
                + tl.dot(b_T31, b_x1, input_precision=PRECISION)
                + tl.dot(b_T32, b_x2, input_precision=PRECISION)
                + tl.dot(b_T33, b_x3, input_precision=PRECISION), r_3, n_3, i_h, HV, K, BC, BK)
    b_y0 = _beta_v(v, b_beta0, r_0, n_0, i_h, stride_vt, stride_vh, V, BC, BV, DOT_DTYPE)
    b_y1 = _beta_v(v, b_beta1, r_1, n_1, i_h, stride_vt, stride_vh, V, BC, BV, DOT_DTYPE)
    b_y2 = _beta_v(v, b_beta2, r_2, n_2, i_h, stride_vt, stride_vh, V, BC, BV, DOT_DTYPE)
    b_y3 = _beta_v(v, b_beta3, r_3, n_3, i_h, stride_vt, stride_vh, V, BC, BV, DOT_DTYPE)
    _store_rows(u, tl.dot(b_T00, b_y0, input_precision=PRECISION), r_0, n_0, i_h, HV, V, BC, BV)
    _store_rows(u, tl.dot(b_T10, b_y0, input_precision=PRECISION)
                + tl.dot(b_T11, b_y1, input_precision=PRECISION), r_1, n_1, i_h, HV, V, BC, BV)
    _store_rows(u, tl.dot(b_T20, b_y0, input_precision=PRECISION)
                + tl.dot(b_T21, b_y1, input_precision=PRECISION)
                + tl.dot(b_T22, b_y2, input_precision=PRECISION), r_2, n_2, i_h, HV, V, BC, BV)
    _store_rows(u, tl.dot(b_T30, b_y0, input_precision=PRECISION)
                + tl.dot(b_T31, b_y1, input_precision=PRECISION)
                + tl.dot(b_T32, b_y2, input_precision=PRECISION)
                + tl.dot(b_T33, b_y3, input_precision=PRECISION), r_3, n_3, i_h, HV, V, BC, BV)


@triton.jit
def chunk_gated_delta_rule_wy_fwd_kernel(
    q, k,
    gc, w, u, aqk,  # from the prepare kernel
    o,  # [num_tokens, HV, V]
    state,  # [num_slots, HV, K, V] fp32
    state_indices,  # [num_seqs]
    cu_seqlens,  # [num_seqs + 1]
    has_initial_state,  # [num_seqs] (HAS_INIT_FLAGS)
    scale,
    stride_qt, stride_qh, stride_kt, stride_kh,
    HK, HV, K, V,
    HAS_INIT_FLAGS: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
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
    p_s = state + (i_slot * HV + i_h) * K * V + o_k[:, None] * V + o_v[None, :]  # [BK, BV]
    b_s = tl.load(p_s, mask=m_k[:, None] & m_v[None, :], other=0.0).to(tl.float32)
    if HAS_INIT_FLAGS:
        # A fresh sequence ignores whatever its slot holds (where, not a product: it may be NaN).
        b_s = tl.where(tl.load(has_initial_state + i_n) != 0, b_s, 0.0)

    for i_start in range(bos, eos, BT):
        num_rows = eos - i_start
        b_q, b_k, _, _ = _load_rows(q, k, gc, gc, i_start, num_rows, i_hk, i_h, scale, stride_qt,
                                    stride_qh, stride_kt, stride_kh, HV, K, USE_QK_L2NORM, BT, BK,
                                    DOT_DTYPE)
        m_t = o_t < num_rows
        # This chunk's rows of the prepare kernel's [num_tokens, HV, ...] buffers, head i_h.
        row = i_start * HV + i_h
        b_gc = tl.load(gc + row + o_t * HV, mask=m_t, other=0.0)
        # The chunk's last real token's decay; padding rows take it too (their k and delta are 0).
        b_g_last = tl.sum(tl.where(o_t == tl.minimum(num_rows, BT) - 1, b_gc, 0.0), axis=0)
        b_gc = tl.where(m_t, b_gc, b_g_last)
        b_w = tl.load(w + row * K + o_t[:, None] * (HV * K) + o_k[None, :],
                      mask=m_t[:, None] & m_k[None, :], other=0.0).to(DOT_DTYPE)
        b_u = tl.load(u + row * V + o_t[:, None] * (HV * V) + o_v[None, :],
                      mask=m_t[:, None] & m_v[None, :], other=0.0).to(tl.float32)
        b_a = tl.load(aqk + row * BT + o_t[:, None] * (HV * BT) + o_t[None, :], mask=m_t[:, None],
                      other=0.0).to(DOT_DTYPE)  # [BT, BT]

        b_s_dot = b_s.to(DOT_DTYPE)
        b_d = b_u - tl.dot(b_w, b_s_dot, input_precision=PRECISION)  # [BT, BV] delta
        b_o = (tl.exp(b_gc)[:, None] * tl.dot(b_q, b_s_dot, input_precision=PRECISION)
               + tl.dot(b_a, b_d.to(DOT_DTYPE), input_precision=PRECISION))
        tl.store(o + row * V + o_t[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        b_kd = tl.trans((b_k.to(tl.float32) * tl.exp(b_g_last - b_gc)[:, None]).to(DOT_DTYPE))
        b_s = b_s * tl.exp(b_g_last) + tl.dot(b_kd, b_d.to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(p_s, b_s, mask=m_k[:, None] & m_v[None, :])


def chunk_gated_delta_rule_wy(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor, *,
    scale: float, use_qk_l2norm: bool, has_initial_state: torch.Tensor, has_init_flags: bool,
    block_v: int = 64,
) -> torch.Tensor:
    """The two-pass chunked form (inputs checked by the caller, `triton.chunk_gated_delta_rule`;
    `has_initial_state` as int32 flags, or any int tensor when `has_init_flags` is False)."""
    T, HK, K = q.shape
    HV, V = v.shape[1:]
    num_seqs = cu_seqlens.shape[0] - 1
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if T == 0 or num_seqs == 0:
        return o
    BK, BV_ALL = max(16, triton.next_power_of_2(K)), max(16, triton.next_power_of_2(V))
    BV = max(16, min(BV_ALL, block_v))
    # Chunks of each sequence, on the device: cu_chunks [num_seqs + 1], and the sequence of each
    # of at most cdiv(T, CHUNK) + num_seqs chunks (num_seqs past the last one).
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    cu_chunks = F.pad(torch.cumsum(torch.div(lens + CHUNK - 1, CHUNK, rounding_mode="floor"), 0), (1, 0))
    max_chunks = triton.cdiv(T, CHUNK) + num_seqs
    chunk_seqs = torch.searchsorted(cu_chunks[1:].contiguous(),
                                    torch.arange(max_chunks, device=q.device), right=True)
    gc = torch.empty(T, HV, dtype=torch.float32, device=q.device)
    w = torch.empty(T, HV, K, dtype=v.dtype, device=q.device)
    u = torch.empty(T, HV, V, dtype=v.dtype, device=q.device)
    aqk = torch.empty(T, HV, CHUNK, dtype=v.dtype, device=q.device)
    g, beta = g.contiguous(), beta.contiguous()
    chunk_gated_delta_rule_wy_prepare_fwd_kernel[(max_chunks, HV)](
        q, k, v, g, beta, gc, w, u, aqk, cu_seqlens, chunk_seqs.to(torch.int32),
        cu_chunks.to(torch.int32), scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        num_seqs, HK, HV, K, V, USE_QK_L2NORM=use_qk_l2norm, BT=CHUNK, BC=BLOCK_C, BK=BK,
        BV=BV_ALL, **dot_args(q.dtype), num_warps=4,
    )
    chunk_gated_delta_rule_wy_fwd_kernel[(triton.cdiv(V, BV), num_seqs * HV)](
        q, k, gc, w, u, aqk, o, state, state_indices, cu_seqlens, has_initial_state, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), HK, HV, K, V,
        HAS_INIT_FLAGS=has_init_flags, USE_QK_L2NORM=use_qk_l2norm, BT=CHUNK, BK=BK, BV=BV,
        **dot_args(q.dtype), num_warps=8,
    )
    return o

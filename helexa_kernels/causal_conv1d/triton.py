"""Depthwise causal conv1d in Triton: varlen prefill and the single-token decode update.

Both kernels give a program one sequence and a tile of BD channels. The prefill program walks
its sequence in tiles of BT tokens; inputs before the sequence's first token come from its
state slot (or are zero for a fresh sequence), and once every read is done it writes the last
width - 1 inputs back as the new state. Layouts as in naive.py; fp32 accumulation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def causal_conv1d_fwd_kernel(
    x,  # [num_tokens, D] (strided)
    w,  # [D, W]
    bias,  # [D] (HAS_BIAS)
    o,  # [num_tokens, D]
    conv_state,  # [num_slots, D, W - 1]
    state_indices,  # [num_seqs]
    cu_seqlens,  # [num_seqs + 1]
    has_initial_state,  # [num_seqs] int32 (HAS_INIT_FLAGS)
    stride_xt, D,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_INIT_FLAGS: tl.constexpr,
    SILU: tl.constexpr,
    BT: tl.constexpr,
    BD: tl.constexpr,
    BS: tl.constexpr,
):
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if i_slot < 0:
        return
    bos, eos = tl.load(cu_seqlens + i_n).to(tl.int64), tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    seq_len = eos - bos
    # Oldest readable state column, as an offset before the first token: W - 1 or none.
    i_first = -(W - 1)
    if HAS_INIT_FLAGS:
        i_first = -(W - 1) * (tl.load(has_initial_state + i_n) != 0).to(tl.int32)
    o_t = tl.arange(0, BT)
    o_d = i_d * BD + tl.arange(0, BD)
    m_d = o_d < D
    p_state = conv_state + i_slot * D * (W - 1) + o_d * (W - 1)  # [BD] column 0 of each channel
    b_bias = tl.zeros([BD], dtype=tl.float32)
    if HAS_BIAS:
        b_bias = tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)

    for i_start in range(0, seq_len, BT):
        i_pos = i_start + o_t  # [BT] position within the sequence
        m_t = i_pos < seq_len
        b_acc = tl.zeros([BT, BD], dtype=tl.float32) + b_bias[None, :]
        for i_w in tl.static_range(W):
            # Tap i_w of output p reads input p + i_w - (W - 1); negative ones live in the state.
            i_src = i_pos + i_w - (W - 1)
            m_x = (m_t & (i_src >= 0))[:, None] & m_d[None, :]
            b_x = tl.load(x + (bos + i_src)[:, None] * stride_xt + o_d[None, :], mask=m_x, other=0.0)
            m_st = (m_t & (i_src < 0) & (i_src >= i_first))[:, None] & m_d[None, :]
            b_st = tl.load(p_state[None, :] + (W - 1 + i_src)[:, None], mask=m_st, other=0.0)
            b_w = tl.load(w + o_d * W + i_w, mask=m_d, other=0.0).to(tl.float32)
            b_acc += (b_x.to(tl.float32) + b_st.to(tl.float32)) * b_w[None, :]
        if SILU:
            b_acc = b_acc * tl.sigmoid(b_acc)
        p_o = o + (bos + i_pos)[:, None] * D + o_d[None, :]
        tl.store(p_o, b_acc.to(o.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])

    # New state column j holds input seq_len - (W - 1) + j: from x, or from the old state.
    o_s = tl.arange(0, BS)
    i_src = seq_len - (W - 1) + o_s  # [BS]
    m_s = (o_s < W - 1)[None, :] & m_d[:, None]  # [BD, BS]
    m_x = m_s & (i_src >= 0)[None, :]
    b_new = tl.load(x + (bos + i_src)[None, :] * stride_xt + o_d[:, None], mask=m_x, other=0.0)
    m_old = m_s & ((i_src < 0) & (i_src >= i_first))[None, :]
    b_old = tl.load(p_state[:, None] + (W - 1 + i_src)[None, :], mask=m_old, other=0.0)
    b_new = b_new.to(tl.float32) + b_old.to(tl.float32)
    # Every thread's reads of the old state are done before any write to it.
    tl.debug_barrier()
    tl.store(p_state[:, None] + o_s[None, :], b_new.to(conv_state.dtype.element_ty), mask=m_s)


@triton.jit
def causal_conv1d_update_fwd_kernel(
    x,  # [num_seqs, D] (strided)
    w,  # [D, W]
    bias,  # [D] (HAS_BIAS)
    o,  # [num_seqs, D]
    conv_state,  # [num_slots, D, W - 1]
    state_indices,  # [num_seqs]
    stride_xn, D,
    W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BD: tl.constexpr,
    BW: tl.constexpr,
):
    i_n, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    i_slot = tl.load(state_indices + i_n).to(tl.int64)
    if i_slot < 0:
        return
    o_d = i_d * BD + tl.arange(0, BD)
    o_w = tl.arange(0, BW)
    m_d = o_d < D
    p_state = conv_state + i_slot * D * (W - 1) + o_d[:, None] * (W - 1) + o_w[None, :]  # [BD, BW]
    # The window: W - 1 state columns, then the new token.
    m_st = m_d[:, None] & (o_w < W - 1)[None, :]
    b_x = tl.load(x + i_n * stride_xn + o_d, mask=m_d, other=0.0).to(tl.float32)  # [BD]
    b_win = tl.load(p_state, mask=m_st, other=0.0).to(tl.float32)
    b_win = tl.where((o_w == W - 1)[None, :], b_x[:, None], b_win)
    b_w = tl.load(w + o_d[:, None] * W + o_w[None, :], mask=m_d[:, None] & (o_w < W)[None, :],
                  other=0.0).to(tl.float32)
    b_o = tl.sum(b_win * b_w, axis=1)
    if HAS_BIAS:
        b_o += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)
    if SILU:
        b_o = b_o * tl.sigmoid(b_o)
    tl.store(o + i_n * D + o_d, b_o.to(o.dtype.element_ty), mask=m_d)
    # Shift left by one: new column j is window column j + 1.
    b_shift = tl.load(p_state + 1, mask=m_d[:, None] & (o_w < W - 2)[None, :], other=0.0).to(tl.float32)
    b_shift = tl.where((o_w == W - 2)[None, :], b_x[:, None], b_shift)
    tl.debug_barrier()
    tl.store(p_state, b_shift.to(conv_state.dtype.element_ty), mask=m_st)


def _prepare(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
             activation: str | None) -> torch.Tensor:
    if activation not in (None, "silu"):
        raise ValueError(f"activation {activation!r}: expected 'silu' or None")
    D = x.shape[1]
    weight = weight.reshape(D, -1).contiguous()
    if weight.shape[1] < 2 or conv_state.shape[1:] != (D, weight.shape[1] - 1):
        raise ValueError("conv_state must be [num_slots, dim, width - 1], width >= 2")
    if not conv_state.is_contiguous() or x.stride(-1) != 1:
        raise ValueError("conv_state must be contiguous and x's last dim contiguous")
    return weight


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  conv_state: torch.Tensor, state_indices: torch.Tensor,
                  cu_seqlens: torch.Tensor, *, has_initial_state: torch.Tensor | None = None,
                  activation: str | None = "silu") -> torch.Tensor:
    """Prefill: x [num_tokens, dim] split by cu_seqlens -> [num_tokens, dim]; each sequence
    starts from conv_state[state_indices[n]] (zeros where not has_initial_state[n]) and leaves
    its last width - 1 inputs there."""
    weight = _prepare(x, weight, conv_state, activation)
    T, D = x.shape
    W = weight.shape[1]
    o = torch.empty(T, D, dtype=x.dtype, device=x.device)
    BD = min(64, triton.next_power_of_2(D))
    causal_conv1d_fwd_kernel[(cu_seqlens.shape[0] - 1, triton.cdiv(D, BD))](
        x, weight, bias if bias is not None else weight, o, conv_state, state_indices, cu_seqlens,
        has_initial_state.to(torch.int32) if has_initial_state is not None else state_indices,
        x.stride(0), D, W=W, HAS_BIAS=bias is not None,
        HAS_INIT_FLAGS=has_initial_state is not None, SILU=activation == "silu",
        BT=32, BD=BD, BS=triton.next_power_of_2(W - 1), num_warps=8,
    )
    return o


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, state_indices: torch.Tensor, *,
                         activation: str | None = "silu") -> torch.Tensor:
    """Decode: one token per sequence, x [num_seqs, dim] -> [num_seqs, dim]; each slot shifts
    by one and takes the new token (slot -1: skipped)."""
    weight = _prepare(x, weight, conv_state, activation)
    N, D = x.shape
    W = weight.shape[1]
    o = torch.empty(N, D, dtype=x.dtype, device=x.device)
    BD = min(256, triton.next_power_of_2(D))
    causal_conv1d_update_fwd_kernel[(N, triton.cdiv(D, BD))](
        x, weight, bias if bias is not None else weight, o, conv_state, state_indices,
        x.stride(0), D, W=W, HAS_BIAS=bias is not None, SILU=activation == "silu",
        BD=BD, BW=triton.next_power_of_2(W),
    )
    return o

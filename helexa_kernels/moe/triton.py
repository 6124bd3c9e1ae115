"""Mixture-of-experts in Triton: routing, and a grouped matmul over expert-sorted rows.

`fused_moe` sorts the (token, expert) pairs by expert, then runs the experts' gate_up as one
grouped matmul, SiLU-and-mul, the down projection as a second grouped matmul, and adds each
pair's weighted row back to its token. The grouped matmul's programs each own a BM-row tile of
one expert: the tile map is built on the device from the expert offsets (no host sync), over
an upper bound of cdiv(M, BM) + E tiles; tiles past the real count return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from helexa_kernels.silu_and_mul import silu_and_mul
from helexa_kernels.utils import dot_args


@triton.jit
def moe_routing_fwd_kernel(
    logits,  # [T, E]
    topk_weights,  # [T, TOP_K] fp32
    topk_ids,  # [T, TOP_K] int32
    E,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    BE: tl.constexpr,
    BK: tl.constexpr,
):
    i_t = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, BE)
    o_k = tl.arange(0, BK)
    b_x = tl.load(logits + i_t * E + o_e, mask=o_e < E, other=float("-inf")).to(tl.float32)
    b_p = tl.exp(b_x - tl.max(b_x, axis=0))
    b_p = b_p / tl.sum(b_p, axis=0)
    b_p = tl.where(o_e < E, b_p, -1.0)  # padding never wins
    b_weights = tl.zeros([BK], dtype=tl.float32)
    b_ids = tl.zeros([BK], dtype=tl.int32)
    for i_k in tl.static_range(TOP_K):
        b_best = tl.max(b_p, axis=0)
        i_best = tl.argmax(b_p, axis=0)  # first index on ties, like torch.topk on CPU
        b_weights = tl.where(o_k == i_k, b_best, b_weights)
        b_ids = tl.where(o_k == i_k, i_best.to(tl.int32), b_ids)
        b_p = tl.where(o_e == i_best, -1.0, b_p)
    if RENORMALIZE:
        b_weights = b_weights / tl.sum(b_weights, axis=0)
    tl.store(topk_weights + i_t * TOP_K + o_k, b_weights, mask=o_k < TOP_K)
    tl.store(topk_ids + i_t * TOP_K + o_k, b_ids, mask=o_k < TOP_K)


def moe_routing(router_logits: torch.Tensor, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, E] -> (topk_weights fp32 [num_tokens, k], topk_ids int32)."""
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k {top_k}: between 1 and the {E} experts")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=router_logits.device)
    if T:
        moe_routing_fwd_kernel[(T,)](router_logits.contiguous(), weights, ids, E, TOP_K=top_k,
                                     RENORMALIZE=renormalize, BE=triton.next_power_of_2(E),
                                     BK=triton.next_power_of_2(top_k))
    return weights, ids


@triton.jit
def grouped_matmul_fwd_kernel(
    x,  # [M, K]
    w,  # [E, N, K]
    o,  # [M, N]
    expert_offsets,  # [E + 1]
    tile_expert,  # [num_tiles] (-1: no tile)
    tile_start,  # [num_tiles] first row of the tile
    N, K,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_tile, i_n = tl.program_id(0), tl.program_id(1)
    i_e = tl.load(tile_expert + i_tile).to(tl.int64)
    if i_e < 0:
        return
    row_start = tl.load(tile_start + i_tile).to(tl.int64)
    row_end = tl.load(expert_offsets + i_e + 1).to(tl.int64)
    o_m = row_start + tl.arange(0, BM)
    o_n = i_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < row_end, o_n < N
    b_acc = tl.zeros([BM, BN], dtype=tl.float32)
    for i_k in range(0, K, BK):
        m_k = i_k + o_k < K
        b_x = tl.load(x + o_m[:, None] * K + i_k + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                      other=0.0)  # [BM, BK]
        b_wt = tl.load(w + i_e * N * K + o_n[None, :] * K + i_k + o_k[:, None],
                       mask=m_n[None, :] & m_k[:, None], other=0.0)  # [BK, BN]
        b_acc += tl.dot(b_x.to(DOT_DTYPE), b_wt.to(DOT_DTYPE), input_precision=PRECISION)
    tl.store(o + o_m[:, None] * N + o_n[None, :], b_acc.to(o.dtype.element_ty),
             mask=m_m[:, None] & m_n[None, :])


def _tile_map(expert_offsets: torch.Tensor, num_rows: int, BM: int):
    """(tile_expert, tile_start), each [cdiv(M, BM) + E], computed on the device."""
    num_experts = expert_offsets.shape[0] - 1
    offsets = expert_offsets.long()
    tiles_per_expert = (offsets[1:] - offsets[:-1] + BM - 1) // BM
    tiles_end = tiles_per_expert.cumsum(0)  # [E]
    tile = torch.arange(triton.cdiv(num_rows, BM) + num_experts, device=offsets.device)
    expert = torch.searchsorted(tiles_end, tile, right=True).clamp(max=num_experts - 1)
    first_tile = tiles_end[expert] - tiles_per_expert[expert]
    tile_start = offsets[expert] + (tile - first_tile) * BM
    tile_expert = torch.where(tile < tiles_end[-1], expert, -1)
    return tile_expert, tile_start


def grouped_matmul(x: torch.Tensor, w: torch.Tensor, expert_offsets: torch.Tensor, *,
                   block_m: int = 64, block_n: int = 64, block_k: int = 32) -> torch.Tensor:
    """Rows expert_offsets[e]:expert_offsets[e + 1] of x [M, K] times w[e]^T, w [E, N, K] -> [M, N]."""
    M, K = x.shape
    E, N, _ = w.shape
    if w.shape[2] != K or expert_offsets.shape != (E + 1,):
        raise ValueError("x [M, K], w [E, N, K], expert_offsets [E + 1]")
    x, w = x.contiguous(), w.contiguous()
    o = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return o
    tile_expert, tile_start = _tile_map(expert_offsets, M, block_m)
    grouped_matmul_fwd_kernel[(tile_expert.shape[0], triton.cdiv(N, block_n))](
        x, w, o, expert_offsets, tile_expert, tile_start, N, K,
        BM=block_m, BN=block_n, BK=block_k, **dot_args(x.dtype),
    )
    return o


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor, **tiles: int) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]), hidden [T, H] -> [T, H];
    w13 [E, 2 * I, H] (gate rows, then up rows), w2 [E, H, I]."""
    T, H = hidden.shape
    E = w13.shape[0]
    flat_ids = topk_ids.reshape(-1).long()  # [T * k], pair p = (token p // k, slot p % k)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // topk_ids.shape[1]
    # Not bincount: it reads the max id back to the host, which a CUDA graph cannot capture.
    counts = torch.zeros(E, dtype=torch.int64, device=hidden.device).index_add_(
        0, flat_ids, torch.ones_like(flat_ids))
    expert_offsets = torch.zeros(E + 1, dtype=torch.int64, device=hidden.device)
    expert_offsets[1:] = counts.cumsum(0)
    x = hidden[token_of]  # [T * k, H], grouped by expert
    y = grouped_matmul(silu_and_mul(grouped_matmul(x, w13, expert_offsets, **tiles)), w2,
                       expert_offsets, **tiles)  # [T * k, H]
    weights = topk_weights.reshape(-1)[order].float()[:, None]
    out = torch.zeros(T, H, dtype=torch.float32, device=hidden.device)
    out.index_add_(0, token_of, y.float() * weights)
    return out.to(hidden.dtype)

"""Paged attention in Triton: one kernel for decode, whole prefills and chunked continuations.

A program owns one sequence, one kv head and a tile of BLOCK_Q queries; its rows are those
queries times the GROUP query heads that share the kv head (row r = query r // GROUP, head
r % GROUP), so each key tile is loaded once per kv head and decode (one query) still fills a
tensor-core tile with the query group. Keys are gathered a token at a time through the block
table, which leaves the key tile size free of the cache's block_size. Online softmax in fp32.
Query i of a sequence sits at position seq_len - query_len + i and sees keys up to there.

Decode with few (sequence, kv head) programs, a small batch, would leave most of the GPU idle
while each program walks its whole context, so there the keys are split too (split-K, as
flash-decoding does): `paged_attention_split_fwd_kernel` gives each of `num_splits` programs a
range of whole key tiles and writes its partial output with its log-sum-exp, and
`paged_attention_split_reduce_kernel` merges the splits. How many: `decode_splits`, from host
ints only (the batch, the kv heads, the longest context the call may see), so a captured CUDA
graph replays the same split whatever the contexts; each program finds its own key range from
its sequence's length on the device, and a range past a short sequence's last key is empty.
"""

from __future__ import annotations

from functools import cache

import torch
import triton
import triton.language as tl

from helexa_kernels.utils import dot_args


@triton.jit
def paged_attention_fwd_kernel(
    q,  # [num_tokens, HK * GROUP, D] (strided)
    k_cache,  # [num_blocks * block_size, HK, D]
    v_cache,  # [num_blocks * block_size, HK, D]
    o,  # [num_tokens, HK * GROUP, D]
    query_start_loc,  # [num_seqs + 1]
    seq_lens,  # [num_seqs]
    block_tables,  # [num_seqs, max_blocks_per_seq]
    scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    HK, block_size,
    skip_chunks_from,  # > 0: leave continuations of at least this many queries to the caller
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_qb, i_n, i_hk = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    bos = tl.load(query_start_loc + i_n).to(tl.int64)
    q_len = tl.load(query_start_loc + i_n + 1).to(tl.int64) - bos
    if i_qb * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens + i_n).to(tl.int64)
    ctx_len = seq_len - q_len
    if (skip_chunks_from > 0) & (q_len >= skip_chunks_from) & (ctx_len > 0):
        return

    o_m = tl.arange(0, BLOCK_M)
    i_q = i_qb * BLOCK_Q + o_m // GROUP  # [BLOCK_M] query index within the sequence
    i_h = i_hk * GROUP + o_m % GROUP  # [BLOCK_M] query head
    m_m = (o_m < BLOCK_Q * GROUP) & (i_q < q_len)
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q + (bos + i_q)[:, None] * stride_qt + i_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]
    b_pos = ctx_len + i_q  # [BLOCK_M] position of each row's query

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # Keys past the tile's last query are never visible: stop there.
    num_keys = tl.minimum(seq_len, ctx_len + (i_qb + 1) * BLOCK_Q)
    for i_start in range(0, num_keys, BLOCK_N):
        o_n = i_start + tl.arange(0, BLOCK_N)
        m_n = o_n < num_keys
        b_block = tl.load(block_tables + i_n * stride_bt + o_n // block_size, mask=m_n, other=0)
        i_slot = b_block.to(tl.int64) * block_size + o_n % block_size  # [BLOCK_N]
        p_kv = i_slot[:, None] * HK * D + i_hk * D + o_d[None, :]  # [BLOCK_N, BLOCK_D]
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k_cache + p_kv, mask=m_kv, other=0.0)
        b_v = tl.load(v_cache + p_kv, mask=m_kv, other=0.0)

        b_s = tl.dot(b_q, tl.trans(b_k.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        m_s = m_n[None, :] & (o_n[None, :] <= b_pos[:, None])  # [BLOCK_M, BLOCK_N]
        b_s = tl.where(m_s, b_s, float("-inf"))
        # Key 0 is visible to every row, so b_m is finite from the first tile on: no NaN.
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(DOT_DTYPE), b_v.to(DOT_DTYPE),
                                                 input_precision=PRECISION)
        b_m = b_m_new

    b_o = b_acc / b_l[:, None]
    p_o = o + (bos + i_q)[:, None] * stride_ot + i_h[:, None] * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


@triton.jit
def paged_attention_split_fwd_kernel(
    q,  # [num_tokens, HK * GROUP, D] (strided), one query per sequence
    k_cache,  # [num_blocks * block_size, HK, D]
    v_cache,  # [num_blocks * block_size, HK, D]
    o_part,  # [num_splits, num_seqs, HK * GROUP, D] fp32
    lse_part,  # [num_splits, num_seqs, HK * GROUP] fp32
    query_start_loc,  # [num_seqs + 1]
    seq_lens,  # [num_seqs]
    block_tables,  # [num_seqs, max_blocks_per_seq]
    scale,
    stride_qt, stride_qh, stride_bt,
    num_seqs, HK, block_size,
    D: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    PRECISION: tl.constexpr,
):
    i_s, i_n, i_hk = tl.program_id(0), tl.program_id(1).to(tl.int64), tl.program_id(2)
    num_splits = tl.num_programs(0)
    token = tl.load(query_start_loc + i_n).to(tl.int64)
    seq_len = tl.load(seq_lens + i_n).to(tl.int64)
    # Whole key tiles per split, so split 0 always holds key 0 (the merge needs one finite lse).
    split_keys = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), num_splits) * BLOCK_N
    k_start = i_s * split_keys
    k_end = tl.minimum(seq_len, k_start + split_keys)

    o_m = tl.arange(0, BLOCK_M)
    i_h = i_hk * GROUP + o_m  # [BLOCK_M] query head
    m_m = o_m < GROUP
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_q = q + token * stride_qt + i_h[:, None] * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0).to(DOT_DTYPE)  # [BLOCK_M, BLOCK_D]

    b_m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    b_l = tl.zeros([BLOCK_M], dtype=tl.float32)
    b_acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The one query sits at seq_len - 1 and sees every key: no causal mask.
    for i_start in range(k_start, k_end, BLOCK_N):
        o_n = i_start + tl.arange(0, BLOCK_N)
        m_n = o_n < k_end
        b_block = tl.load(block_tables + i_n * stride_bt + o_n // block_size, mask=m_n, other=0)
        i_slot = b_block.to(tl.int64) * block_size + o_n % block_size  # [BLOCK_N]
        p_kv = i_slot[:, None] * HK * D + i_hk * D + o_d[None, :]  # [BLOCK_N, BLOCK_D]
        m_kv = m_n[:, None] & m_d[None, :]
        b_k = tl.load(k_cache + p_kv, mask=m_kv, other=0.0)
        b_v = tl.load(v_cache + p_kv, mask=m_kv, other=0.0)

        b_s = tl.dot(b_q, tl.trans(b_k.to(DOT_DTYPE)), input_precision=PRECISION) * scale
        b_s = tl.where(m_n[None, :], b_s, float("-inf"))
        # The tile's first key is inside the range: b_m is finite from the first tile on.
        b_m_new = tl.maximum(b_m, tl.max(b_s, axis=1))
        b_alpha = tl.exp(b_m - b_m_new)
        b_p = tl.exp(b_s - b_m_new[:, None])
        b_l = b_l * b_alpha + tl.sum(b_p, axis=1)
        b_acc = b_acc * b_alpha[:, None] + tl.dot(b_p.to(DOT_DTYPE), b_v.to(DOT_DTYPE),
                                                 input_precision=PRECISION)
        b_m = b_m_new

    # An empty range (past a short sequence's last key) leaves l = 0: weight 0 in the merge.
    has_keys = b_l > 0
    b_l_safe = tl.where(has_keys, b_l, 1.0)
    b_o = tl.where(has_keys[:, None], b_acc / b_l_safe[:, None], 0.0)
    b_lse = tl.where(has_keys, b_m + tl.log(b_l_safe), float("-inf"))
    i_part = (i_s * num_seqs + i_n) * HK * GROUP + i_h  # [BLOCK_M]
    tl.store(o_part + i_part[:, None] * D + o_d[None, :], b_o, mask=m_m[:, None] & m_d[None, :])
    tl.store(lse_part + i_part, b_lse, mask=m_m)


@triton.jit
def paged_attention_split_reduce_kernel(
    o_part,  # [num_splits, num_seqs, H, D] fp32
    lse_part,  # [num_splits, num_seqs, H] fp32
    o,  # [num_tokens, H, D]
    query_start_loc,  # [num_seqs + 1]
    stride_ot, stride_oh,
    num_seqs, H, num_splits,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_n, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    token = tl.load(query_start_loc + i_n).to(tl.int64)
    o_s = tl.arange(0, BLOCK_S)
    m_s = o_s < num_splits
    o_d = tl.arange(0, BLOCK_D)
    m_d = o_d < D
    i_part = (o_s * num_seqs + i_n) * H + i_h  # [BLOCK_S]
    b_lse = tl.load(lse_part + i_part, mask=m_s, other=float("-inf"))
    b_w = tl.exp(b_lse - tl.max(b_lse, axis=0))  # split 0's lse is finite: no NaN
    b_o = tl.load(o_part + i_part[:, None] * D + o_d[None, :], mask=m_s[:, None] & m_d[None, :],
                  other=0.0)
    b_o = tl.sum(b_w[:, None] * b_o, axis=0) / tl.sum(b_w, axis=0)
    tl.store(o + token * stride_ot + i_h * stride_oh + o_d, b_o.to(o.dtype.element_ty), mask=m_d)


# Split decode only while the (sequence, kv head) programs fill fewer than this many waves of
# the GPU's multiprocessors, and into no more than MAX_SPLITS ranges of at least
# MIN_SPLIT_KEYS keys each: past that the merge costs more than the split gains.
SPLIT_WAVES = 2
MAX_SPLITS = 16
MIN_SPLIT_KEYS = 64
# Multiprocessors assumed where there are none to count (Triton's CPU interpreter).
NOMINAL_SMS = 4


@cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return NOMINAL_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def decode_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Key ranges per (sequence, kv head) for a decode: 1 when the batch alone fills the GPU."""
    programs = num_seqs * num_kv_heads
    by_occupancy = triton.cdiv(SPLIT_WAVES * _multiprocessors(device), programs)
    by_length = triton.cdiv(max_seq_len, MIN_SPLIT_KEYS)
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


def _tiles(decode: bool, dtype: torch.dtype) -> tuple[int, int, int]:
    """(block_m, block_n, num_warps): for head_dim 128, the tiles ptxas fits in sm_90 registers
    without spilling (tests/kernels/compile_sm90.py reports it); keys are gathered slot by slot,
    whose int64 addresses take registers, so key tiles stay narrow."""
    if dtype == torch.float32:
        return 16, 16, (4 if decode else 8)
    return 64, 32, (4 if decode else 8)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    block_tables: torch.Tensor, max_query_len: int, scale: float,
                    *, block_m: int | None = None, block_n: int | None = None,
                    max_seq_len: int | None = None, num_splits: int | None = None,
                    skip_chunks_from: int = 0) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (stored already).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]; caches
    [num_blocks, block_size, num_kv_heads, head_dim]; query_start_loc [num_seqs + 1] (cu_seqlens
    of the queries), seq_lens [num_seqs] (context after this step), block_tables
    [num_seqs, max_blocks_per_seq]. GQA: query head h reads kv head h // (num_heads // num_kv_heads).
    `max_query_len` (a host int) picks the decode or prefill tiling and sizes the grid.
    Decode only: `max_seq_len` (a host int, at least every seq_len; default the block tables'
    capacity) bounds how many key ranges `decode_splits` picks; `num_splits` sets it instead.
    `skip_chunks_from` > 0: the rows of every chunk continuation (queries after a cached
    context) with at least that many queries are left unwritten, for the caller to fill.
    """
    num_tokens, H, D = q.shape
    _, block_size, HK, _ = k_cache.shape
    if H % HK or k_cache.shape[-1] != D or not k_cache.is_contiguous() or not v_cache.is_contiguous():
        raise ValueError("q heads must be a multiple of kv heads; caches contiguous, same head_dim")
    if q.stride(-1) != 1:
        raise ValueError("q needs a contiguous last dim")
    group = H // HK
    o = torch.empty(num_tokens, H, D, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return o
    decode = max_query_len == 1
    default_m, default_n, num_warps = _tiles(decode, q.dtype)
    BLOCK_N = block_n or default_n
    num_seqs = seq_lens.shape[0]
    if decode:
        if num_splits is None:
            capacity = block_tables.shape[1] * block_size
            num_splits = decode_splits(num_seqs, HK, max_seq_len or capacity, q.device)
        if num_splits > 1:
            _split_decode(q, k_cache, v_cache, o, query_start_loc, seq_lens, block_tables, scale,
                          num_splits, BLOCK_N, num_warps)
            return o
        # The rows are just the query group, padded to the smallest dot tile.
        BLOCK_Q, BLOCK_M = 1, max(16, triton.next_power_of_2(group))
    else:
        BLOCK_M = max(16, block_m or default_m, triton.next_power_of_2(group))
        BLOCK_Q = BLOCK_M // group
    grid = (triton.cdiv(max_query_len, BLOCK_Q), num_seqs, HK)
    paged_attention_fwd_kernel[grid](
        q, k_cache, v_cache, o, query_start_loc, seq_lens, block_tables, scale,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1), block_tables.stride(0),
        HK, block_size, skip_chunks_from, D=D, GROUP=group, BLOCK_Q=BLOCK_Q, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(D)), num_warps=num_warps, **dot_args(q.dtype),
    )
    return o


def _split_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, o: torch.Tensor,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  scale: float, num_splits: int, block_n: int, num_warps: int) -> None:
    """One query per sequence, its keys in `num_splits` ranges merged by their log-sum-exp, into o."""
    _, H, D = q.shape
    HK, block_size = k_cache.shape[2], k_cache.shape[1]
    group, num_seqs = H // HK, seq_lens.shape[0]
    o_part = torch.empty(num_splits, num_seqs, H, D, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(num_splits, num_seqs, H, dtype=torch.float32, device=q.device)
    BLOCK_D = max(16, triton.next_power_of_2(D))
    paged_attention_split_fwd_kernel[(num_splits, num_seqs, HK)](
        q, k_cache, v_cache, o_part, lse_part, query_start_loc, seq_lens, block_tables, scale,
        q.stride(0), q.stride(1), block_tables.stride(0), num_seqs, HK, block_size,
        D=D, GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n,
        BLOCK_D=BLOCK_D, num_warps=num_warps, **dot_args(q.dtype),
    )
    paged_attention_split_reduce_kernel[(num_seqs, H)](
        o_part, lse_part, o, query_start_loc, o.stride(0), o.stride(1), num_seqs, H, num_splits,
        D=D, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=BLOCK_D, num_warps=4,
    )

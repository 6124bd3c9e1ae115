"""PyTorch reference for paged attention: a plain loop over sequences.

Deliberately the simplest correct form (gather one sequence's keys through its block table,
mask, softmax in fp32) so it can referee both the Triton kernel and the engine's batched
`engine.runner.attention.paged_attention`.
"""

from __future__ import annotations

import torch


def naive_paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                          block_tables: torch.Tensor, max_query_len: int,
                          scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (stored already).

    q: [num_tokens, num_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    sequence i owns q rows query_start_loc[i]:query_start_loc[i + 1], which are its last
    query_len positions of seq_lens[i]. `max_query_len` is unused (kept for a shared signature).
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    group = q.shape[1] // num_kv_heads
    k_flat = k_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    v_flat = v_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        bos, eos = starts[i], starts[i + 1]
        q_len = eos - bos
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        keys = k_flat[slots].float().repeat_interleave(group, dim=1)  # [seq_len, num_heads, D]
        values = v_flat[slots].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[bos:eos].float(), keys) * scale
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[bos:eos] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).to(q.dtype)
    return out

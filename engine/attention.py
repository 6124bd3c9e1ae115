"""Paged attention: how attention layers store keys/values in cache blocks and read them back.

Model files call `engine.ops.attention(...)` with one layer's (k_cache, v_cache) and the step's
`AttentionMetadata` (built in `engine.step_metadata`); they never index cache tensors themselves.
This module owns the batched PyTorch form of paged attention that `engine.ops` runs off CUDA (the
KV store reference lives in kernels/kv_store/naive.py, the loop-per-sequence referee in
kernels/paged_attention/naive.py). A cache is
[num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`, i.e. flat slot
`block_id * block_size + offset`.

One batch mixes whole prefills, chunked-prefill continuations (queries start mid-sequence and
see earlier keys through the cache) and decodes (one query each). `paged_attention` is the
PyTorch path: gather every sequence's keys into a padded batch, pad the queries, and make
one `scaled_dot_product_attention` call under one causal+padding mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Model files import the metadata and cache types from here, beside the computation that reads them.
from engine.step_metadata import AttentionMetadata, KVCache  # noqa: F401


def _build_mask(meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
    """[num_seqs, 1, max_query_len, max_seq_len] bool, True where query i may see key j.

    Query i of a sequence sits at position seq_len - query_len + i. Padding queries (i past the
    sequence's query_len) get a bound of at least seq_len - 1, so no row is fully masked (SDPA
    would return NaN for it); their outputs are dropped anyway.
    """
    seq_lens = meta.seq_lens.to(device=device, dtype=torch.int64)
    query_lens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).to(device, torch.int64)
    query_idx = torch.arange(meta.max_query_len, device=device)
    key_pos = torch.arange(meta.max_seq_len, device=device)
    last_visible = (seq_lens - query_lens)[:, None] + query_idx[None, :]  # [num_seqs, max_q]
    mask = ((key_pos[None, None, :] <= last_visible[:, :, None])
            & (key_pos[None, None, :] < seq_lens[:, None, None]))
    return mask[:, None]


def _build_query_pad_index(meta: AttentionMetadata, num_tokens: int,
                           device: torch.device) -> torch.Tensor:
    """[num_tokens] int64: row of each flat token in the padded [num_seqs * max_query_len]."""
    starts = meta.query_start_loc.to(device=device, dtype=torch.int64)
    query_lens = starts[1:] - starts[:-1]
    seq_idx = torch.repeat_interleave(torch.arange(meta.num_seqs, device=device), query_lens,
                                      output_size=num_tokens)
    idx_in_seq = torch.arange(num_tokens, device=device) - starts[seq_idx]
    return seq_idx * meta.max_query_len + idx_in_seq


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (stored already).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. GQA: query head h
    reads kv head h // (num_heads // num_kv_heads).
    """
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_seqs, max_q, max_len = meta.num_seqs, meta.max_query_len, meta.max_seq_len
    if meta._mask is None:
        meta._mask = _build_mask(meta, q.device)

    num_blocks = -(-max_len // block_size)
    # index_select on the flattened table: faster on CPU than advanced indexing k_cache[block_ids].
    block_ids = meta.block_tables[:, :num_blocks].reshape(-1)
    gathered_shape = (num_seqs, num_blocks * block_size, num_kv_heads, head_dim)
    # [num_seqs * num_blocks, block_size, ...] -> [num_seqs, kv_heads, max_len, head_dim]
    keys = k_cache.index_select(0, block_ids).view(gathered_shape)[:, :max_len].transpose(1, 2)
    values = v_cache.index_select(0, block_ids).view(gathered_shape)[:, :max_len].transpose(1, 2)

    if meta.is_pure_decode:
        # One query per sequence: fold each kv head's query group into the query axis, so the
        # keys are read once per kv head instead of being repeated per query head.
        q = q.view(num_seqs, num_kv_heads, group, head_dim)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta._mask, scale=scale)
        return out.reshape(num_tokens, num_heads, head_dim)

    if meta._query_pad_index is None:
        meta._query_pad_index = _build_query_pad_index(meta, num_tokens, q.device)
    pad_index = meta._query_pad_index
    padded = q.new_zeros(num_seqs * max_q, num_heads, head_dim)
    padded[pad_index] = q
    padded = padded.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(padded, keys, values, attn_mask=meta._mask, scale=scale,
                                         enable_gqa=group > 1)
    # [num_seqs, num_heads, max_q, head_dim] -> [num_seqs * max_q, num_heads, head_dim]
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out[pad_index]


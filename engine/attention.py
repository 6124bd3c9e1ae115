"""Paged attention: how attention layers store keys/values in cache blocks and read them back.

Model files call `engine.ops.attention(...)` with one layer's (k_cache, v_cache) and the step's
`AttentionMetadata`; they never index cache tensors themselves. This module owns the metadata
and the batched PyTorch form of paged attention that `engine.ops` runs off CUDA (the KV store
reference lives in kernels/kv_store/naive.py, the loop-per-sequence referee in
kernels/paged_attention/naive.py). A cache is
[num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`, i.e. flat slot
`block_id * block_size + offset`.

One batch mixes whole prefills, chunked-prefill continuations (queries start mid-sequence and
see earlier keys through the cache) and decodes (one query each). `paged_attention` is the
PyTorch path; it does the batch's work and not its padding: decodes in length buckets, each
through one folded-GQA SDPA call over its own gather, and every prefill or chunk through its own
SDPA call over its own keys (how the step is split: `engine.attention_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine import torch_ops
from engine.attention_plan import AttentionPlan, DecodeBucket, PrefillSeq, build_plan

KVCache = tuple[torch.Tensor, torch.Tensor]


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each of them may attend to.

    Tokens are flat: sequence i owns rows query_start_loc[i]:query_start_loc[i+1] of q/k/v,
    and those rows are its last query_len positions of seq_lens[i].
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat cache slot of each new token's K/V
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cu_seqlens of the new tokens
    seq_lens: torch.Tensor  # [num_seqs] int32, context per sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # The torch path's split of the step (engine.attention_plan), built on the first layer's
    # call and shared by the rest of the step (same for every layer).
    _plan: AttentionPlan | None = field(default=None, init=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
        """From host lists: each sequence's new-token count, total length and block ids."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)) or not query_lens:
            raise ValueError("query_lens, seq_lens and block_tables must be non-empty, same length")
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables, strict=True):
            if not 1 <= q_len <= s_len or len(table) * block_size < s_len:
                raise ValueError(f"bad sequence: query_len {q_len}, seq_len {s_len}, "
                                 f"{len(table)} blocks of {block_size}")
            slots += [table[p // block_size] * block_size + p % block_size
                      for p in range(s_len - q_len, s_len)]
        max_blocks = max(len(table) for table in block_tables)
        padded_tables = [table + [0] * (max_blocks - len(table)) for table in block_tables]
        cu_seqlens = [0]
        for q_len in query_lens:
            cu_seqlens.append(cu_seqlens[-1] + q_len)
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(cu_seqlens, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
        )


def allocate_kv_caches(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                       head_dim: int, dtype: torch.dtype = torch.float32,
                       device: torch.device | str = "cpu") -> list[KVCache]:
    """One zeroed (k_cache, v_cache) pair per attention layer, each
    [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device),
             torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]


def plan_for(meta: AttentionMetadata, block_size: int, device: torch.device) -> AttentionPlan:
    """The step's split, built on its first layer and kept on the metadata for the others."""
    if meta._plan is None:
        meta._plan = build_plan(meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                meta.slot_mapping, block_size, device)
    return meta._plan


def store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The PyTorch path of a model's attention call: store this step's k/v, then attend."""
    plan = plan_for(meta, k_cache.shape[1], q.device)
    torch_ops.kv_store(k, v, k_cache, v_cache, meta.slot_mapping, plan.slots_valid)
    return paged_attention(q, k_cache, v_cache, meta, scale, k, v)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (stored already).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. GQA: query head h
    reads kv head h // (num_heads // num_kv_heads). `k`/`v` [num_tokens, num_kv_heads, head_dim],
    this step's keys as stored, let a whole prefill attend without gathering them back.
    """
    plan = plan_for(meta, k_cache.shape[1], q.device)
    num_tokens, num_heads, head_dim = q.shape
    decode = plan.decode
    if len(decode) == 1 and decode[0].token_rows is None:  # a pure decode step, in batch order
        return _decode(q, k_cache, v_cache, decode[0], scale).view(num_tokens, num_heads, head_dim)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for bucket in decode:
        rows = bucket.token_rows
        assert rows is not None
        result = _decode(q.index_select(0, rows), k_cache, v_cache, bucket, scale)
        out.index_copy_(0, rows, result.view(bucket.num_seqs, num_heads, head_dim))
    for seq in plan.prefill:
        out[seq.start:seq.end] = _prefill(q, k_cache, v_cache, seq, scale, k, v)
    return out


def _decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: DecodeBucket,
            scale: float) -> torch.Tensor:
    """One query per row over the bucket's gathered keys -> [n, kv_heads, group, head_dim]."""
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    n, length = bucket.num_seqs, bucket.max_len
    gathered = (n, bucket.num_blocks * block_size, num_kv_heads, head_dim)
    # index_select on the flat table: faster on CPU than advanced indexing k_cache[block_ids].
    # [n * num_blocks, block_size, ...] -> [n, kv_heads, length, head_dim]
    keys = k_cache.index_select(0, bucket.block_ids).view(gathered)[:, :length].transpose(1, 2)
    values = v_cache.index_select(0, bucket.block_ids).view(gathered)[:, :length].transpose(1, 2)
    # Fold each kv head's query group into the query axis: keys are read once per kv head.
    q = q.view(n, num_kv_heads, -1, head_dim)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=bucket.mask, scale=scale)


def _prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seq: PrefillSeq,
             scale: float, k: torch.Tensor | None, v: torch.Tensor | None) -> torch.Tensor:
    """One sequence's queries over its own keys -> [q_len, num_heads, head_dim]."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    queries = q[seq.start:seq.end].transpose(0, 1)[None]  # [1, num_heads, q_len, head_dim]
    group = q.shape[1] // num_kv_heads
    if seq.mask is None and k is not None and v is not None:
        keys = k[seq.start:seq.end].transpose(0, 1)[None]
        values = v[seq.start:seq.end].transpose(0, 1)[None]
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                             enable_gqa=group > 1)
        return out[0].transpose(0, 1)
    shape = (1, -1, num_kv_heads, head_dim)
    keys = k_cache.index_select(0, seq.block_ids).view(shape)[:, :seq.seq_len].transpose(1, 2)
    values = v_cache.index_select(0, seq.block_ids).view(shape)[:, :seq.seq_len].transpose(1, 2)
    if seq.mask is None:
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale,
                                             enable_gqa=group > 1)
    else:
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=seq.mask,
                                             scale=scale, enable_gqa=group > 1)
    return out[0].transpose(0, 1)

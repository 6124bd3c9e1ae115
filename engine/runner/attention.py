"""Paged attention: how attention layers store keys/values in cache blocks and read them back.

Model files call `engine.runner.ops.attention(...)` with one layer's (k_cache, v_cache) and the step's
`AttentionMetadata` (built in `engine.runner.step_metadata`); they never index cache tensors themselves.
This module owns the batched PyTorch form of paged attention that `engine.runner.ops` runs off CUDA (the
KV store reference lives in helexa_kernels/kv_store/naive.py, the loop-per-sequence referee in
helexa_kernels/paged_attention/naive.py). A cache is
[num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in block
`block_table[t // block_size]` at offset `t % block_size`, i.e. flat slot
`block_id * block_size + offset`.

One batch mixes whole prefills, chunked-prefill continuations (queries start mid-sequence and
see earlier keys through the cache) and decodes (one query each). `paged_attention` is the
PyTorch path; it does the batch's work and not its padding: decodes in length buckets, each
through one folded-GQA SDPA call over its own gather, and every prefill or chunk through its own
SDPA call over its own keys (how the step is split: `engine.runner.attention_plan`). With
`decode_kernel` (engine.runner.ops decides: the C++ CPU kernels of helexa_kernels/cpu.py, built), every decode
row, and every row of a short chunk continuation, goes through the CPU decode kernel instead: one
call that reads keys and values through the block tables, nothing gathered or padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.runner import attention_plan
from engine.runner.attention_plan import AttentionPlan, DecodeBucket, PrefillSeq, build_plan, sdpa_chunk_seqs

# Model files import the metadata and cache types from here, beside the computation that reads them.
from engine.runner.step_metadata import AttentionMetadata, KVCache  # noqa: F401  (KVCache: re-exported)
from helexa_kernels import cpu as cpu_kernels
from helexa_kernels.kv_store import aten as kv_store_aten


def plan_for(meta: AttentionMetadata, block_size: int, device: torch.device,
             decode_kernel: bool = False) -> AttentionPlan:
    """The step's split, built on its first layer and kept on the metadata for the others."""
    if meta._plan is None:
        meta._plan = build_plan(meta.query_start_loc, meta.seq_lens, meta.block_tables,
                                meta.slot_mapping, block_size, device, decode_kernel)
    return meta._plan


def sdpa_chunks(meta: AttentionMetadata, block_size: int, device: torch.device) -> list[PrefillSeq]:
    """The step's long chunk continuations, which the Triton path leaves to SDPA
    (`engine.runner.attention_plan.SDPA_CHUNK_MIN_QUERIES`): found on the first layer, kept for the
    others; none where the metadata has no host lengths (CUDA-graph decode steps)."""
    if meta._sdpa_chunks is None:
        if meta.query_lens_host is None or meta.seq_lens_host is None or meta.max_query_len == 1:
            meta._sdpa_chunks = []
        else:
            meta._sdpa_chunks = sdpa_chunk_seqs(meta.query_lens_host, meta.seq_lens_host,
                                                meta.block_tables, block_size, device,
                                                attention_plan.SDPA_CHUNK_MIN_QUERIES)
    return meta._sdpa_chunks


def attend_chunks(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  chunks: list[PrefillSeq], scale: float) -> None:
    """Each chunk continuation's rows of `out`, through SDPA over its gathered keys."""
    for seq in chunks:
        out[seq.start:seq.end] = _prefill(q, k_cache, v_cache, seq, scale, None, None)


def store_and_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     decode_kernel: bool = False, store_kernel: bool = False) -> torch.Tensor:
    """The PyTorch path of a model's attention call: store this step's k/v (`store_kernel`:
    through the CPU kernel, which must be built), then attend."""
    plan = plan_for(meta, k_cache.shape[1], q.device, decode_kernel)
    if store_kernel:
        cpu_kernels.kv_store(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        kv_store_aten.kv_store(k, v, k_cache, v_cache, meta.slot_mapping, plan.slots_valid)
    return paged_attention(q, k_cache, v_cache, meta, scale, k, v, decode_kernel)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, k: torch.Tensor | None = None,
                    v: torch.Tensor | None = None, decode_kernel: bool = False) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (stored already).

    q: [num_tokens, num_heads, head_dim] -> [num_tokens, num_heads, head_dim]. GQA: query head h
    reads kv head h // (num_heads // num_kv_heads). `k`/`v` [num_tokens, num_kv_heads, head_dim],
    this step's keys as stored, let a whole prefill attend without gathering them back.
    `decode_kernel`: decode rows through the CPU decode kernel (it must be built).
    """
    plan = plan_for(meta, k_cache.shape[1], q.device, decode_kernel)
    num_tokens, num_heads, head_dim = q.shape
    if plan.kernel_rows is not None:
        out = q.new_empty(num_tokens, num_heads, head_dim)
        rows = plan.kernel_rows
        cpu_kernels.paged_decode_attention(out, q, k_cache, v_cache, rows.block_tables, rows.key_lens,
                                          rows.token_rows, rows.seq_rows, scale)
        for seq in plan.prefill:
            out[seq.start:seq.end] = _prefill(q, k_cache, v_cache, seq, scale, k, v)
        return out
    decode = plan.decode
    # reshape, not view: _decode's result is [n, kv_heads, group, head_dim], and CUDA's flash and
    # memory-efficient SDPA kernels lay it out in memory as [n, group, kv_heads, head_dim], which
    # no view can merge into heads (CPU returns it contiguous, where reshape is a view).
    if len(decode) == 1 and decode[0].token_rows is None:  # a pure decode step, in batch order
        return _decode(q, k_cache, v_cache, decode[0], scale).reshape(num_tokens, num_heads, head_dim)
    out = q.new_empty(num_tokens, num_heads, head_dim)
    for bucket in decode:
        rows = bucket.token_rows
        assert rows is not None
        result = _decode(q.index_select(0, rows), k_cache, v_cache, bucket, scale)
        out.index_copy_(0, rows, result.reshape(bucket.num_seqs, num_heads, head_dim))
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

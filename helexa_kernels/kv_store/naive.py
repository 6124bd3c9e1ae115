"""PyTorch reference for writing new keys/values into the paged KV cache."""

from __future__ import annotations

import torch


def naive_kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write k, v [num_tokens, num_kv_heads, head_dim] into caches
    [num_blocks, block_size, num_kv_heads, head_dim] at flat slots; slot -1 is skipped."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    flat_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    k_cache.view(flat_shape).index_copy_(0, slots, k[keep].to(k_cache.dtype))
    v_cache.view(flat_shape).index_copy_(0, slots, v[keep].to(v_cache.dtype))

"""PyTorch reference for the attention prologue: the three ops it fuses, one after the other.

q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim] are each
normalized per head (RMSNorm over head_dim, rounded to their dtype as the norm op does) when
their weights are given, then rotated (rotate-half RoPE over the first rotary_dim dims), and the
rotated k and v go to the paged caches at `slot_mapping` (-1: no slot).
"""

from __future__ import annotations

import torch

from helexa_kernels.kv_store.naive import naive_kv_store
from helexa_kernels.rmsnorm.naive import naive_rms_norm
from helexa_kernels.rotary.naive import naive_rotary


def naive_rotary_kv_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                          k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          q_norm_weight: torch.Tensor | None = None,
                          k_norm_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                          unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q, k) normalized and rotated (new tensors); k and v stored in the caches."""
    if (q_norm_weight is None) != (k_norm_weight is None):
        raise ValueError("q and k are normalized together or not at all")
    if q_norm_weight is not None and k_norm_weight is not None:
        q = naive_rms_norm(q, q_norm_weight, eps, unit_offset=unit_offset)
        k = naive_rms_norm(k, k_norm_weight, eps, unit_offset=unit_offset)
    q, k = naive_rotary(q, k, positions, cos_sin_cache)
    naive_kv_store(k, v, k_cache, v_cache, slot_mapping)
    return q, k

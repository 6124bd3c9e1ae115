"""How attention layers store and read keys/values: today, one contiguous cache per request.

Model files call `attention(...)` and never touch cache tensors themselves, so swapping this module
for the paged KV cache changes no model code. The cache is preallocated for the request's whole
length; positions index straight into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ContiguousKVCache:
    """Keys and values of one sequence for every layer, preallocated up to `max_len` tokens."""

    def __init__(self, num_layers: int, max_len: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.max_len = max_len
        # [num_layers, num_kv_heads, max_len, head_dim]: heads-first so a layer's slice feeds SDPA.
        shape = (num_layers, num_kv_heads, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    kv_cache: ContiguousKVCache | None,
    layer_idx: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over everything before them.

    q: [num_tokens, num_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim];
    positions: [num_tokens], increasing and contiguous. Without a cache the tokens are the whole
    sequence. Returns [num_tokens, num_heads, head_dim].
    """
    num_tokens = q.shape[0]
    q = q.transpose(0, 1)  # [num_heads, num_tokens, head_dim]
    if kv_cache is None:
        keys, values = k.transpose(0, 1), v.transpose(0, 1)
        context_len = num_tokens
    else:
        # Reading the last position back to the host is fine for a one-sequence CPU engine.
        context_len = int(positions[-1]) + 1
        if context_len > kv_cache.max_len:
            raise ValueError(
                f"position {context_len - 1} is past the KV cache ({kv_cache.max_len} slots)")
        kv_cache.k[layer_idx][:, positions] = k.transpose(0, 1)
        kv_cache.v[layer_idx][:, positions] = v.transpose(0, 1)
        keys = kv_cache.k[layer_idx][:, :context_len]
        values = kv_cache.v[layer_idx][:, :context_len]

    if num_tokens == 1:
        mask = None  # a single newest token sees the whole context
    else:
        key_positions = torch.arange(context_len, device=q.device)
        mask = key_positions[None, :] <= positions[:, None]  # [num_tokens, context_len]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                         enable_gqa=q.shape[0] != keys.shape[0])
    return out.transpose(0, 1)

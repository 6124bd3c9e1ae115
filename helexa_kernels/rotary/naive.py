"""PyTorch reference for rotate-half RoPE, with partial rotary (first rotary_dim dims only)."""

from __future__ import annotations

import torch


def build_cos_sin_cache(inv_freq: torch.Tensor, max_position: int,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[max_position, rotary_dim]: cos of each position's angles, then their sin.

    inv_freq: [rotary_dim / 2], the per-pair frequencies (scaling already applied).
    """
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]  # [max_position, rotary_dim / 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x_rot = x[..., :2 * half].float()
    x1, x2 = x_rot[..., :half], x_rot[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return torch.cat((rotated.to(x.dtype), x[..., 2 * half:]), dim=-1)


def naive_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q [num_tokens, num_heads, head_dim] and k [num_tokens, num_kv_heads, head_dim].

    rotary_dim = cos_sin_cache.shape[-1]; dims past it pass through unchanged. Out of place.
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [num_tokens, rotary_dim / 2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)

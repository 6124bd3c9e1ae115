"""Rotate-half RoPE in few ATen calls: cos/sin gathered once per step (`rotary_tables`: every layer
rotates at the same positions), then x * cos + swap(x) * sin_signed in fp32; q and k in one pass when
they sit side by side in a packed projection's output. The PyTorch path's form, tested against
`naive.py`."""

from __future__ import annotations

import torch


def rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin_signed) [num_tokens, 1, rotary_dim] fp32 at `positions`: gathered once per step,
    since every layer rotates at the same positions. cos for both halves; -sin then +sin for the
    swapped halves."""
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [num_tokens, rotary_dim / 2]
    return torch.cat((cos, cos), -1)[:, None], torch.cat((-sin, sin), -1)[:, None]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]
    x_rot = x[..., :rotary_dim].float()
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.addcmul(x_rot * cos, torch.cat((x2, x1), -1), sin_signed)
    if rotary_dim == x.shape[-1]:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)


def rotary(q: torch.Tensor, k: torch.Tensor,
           tables: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE of q [T, H, D] and k [T, HK, D] (first rotary_dim dims) with the step's
    `rotary_tables`; out of place."""
    cos, sin_signed = tables
    joint = _side_by_side(q, k)
    if joint is not None:  # one pass over both
        rotated = _rotate(joint, cos, sin_signed)
        return rotated[:, :q.shape[1]], rotated[:, q.shape[1]:]
    return _rotate(q, cos, sin_signed), _rotate(k, cos, sin_signed)


def _side_by_side(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """q and k as one [T, H + HK, D] view when k's heads follow q's in memory, row by row (the
    output of a packed qkv projection, cut by `PackedLinear.split`); else None."""
    num_tokens, num_heads, head_dim = q.shape
    joint_heads = num_heads + k.shape[1]
    if (k.dtype != q.dtype or k.shape[0] != num_tokens or k.shape[2] != head_dim
            or q.stride() != k.stride() or q.stride()[1:] != (head_dim, 1)
            or q.stride(0) < joint_heads * head_dim
            or k.untyped_storage().data_ptr() != q.untyped_storage().data_ptr()
            or k.storage_offset() != q.storage_offset() + num_heads * head_dim):
        return None
    return q.as_strided((num_tokens, joint_heads, head_dim), q.stride())

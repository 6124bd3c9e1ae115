"""The PyTorch forms of the hot ops that the engine runs off CUDA, written for few ATen calls.

The references in `helexa_kernels/<op>/naive.py` are the plainest correct form, and they upcast,
slice and concatenate freely; on CPU every such call costs dispatch time, and a decode step of
SmolLM2 made ~7,200 of them. These forms compute the same thing (tested against the references)
with fewer ATen calls, in-place where the intermediate is their own:

- `rms_norm` / `fused_add_rms_norm`: torch's fused `rms_norm` (statistics in fp32), or in-place
  fp32 scaling where it does not apply; the residual add in place before it;
- `silu_and_mul`: silu(gate) * up in the model dtype (fp32 inside each op);
- `rotary`: cos/sin gathered once per step (`rotary_tables`: every layer rotates at the same
  positions) and a rotate-half as x * cos + swap(x) * sin_signed, in fp32; q and k in one pass
  when they sit side by side in a packed projection's output;
- `kv_store`: one `index_copy_` per cache when the step has no padding slots (-1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from helexa_kernels.kv_store.naive import naive_kv_store


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, *,
             unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * w in fp32, rounded once to x's dtype. torch's own fused op where it applies
    (no unit offset, and a weight in x's dtype or x in fp32, such as the fp32 residual stream of a
    bf16 model, whose weight is cast up exactly: the same numbers, ~40 % faster on CPU); else the
    reference's math in six ATen calls."""
    if not unit_offset and (weight.dtype == x.dtype or x.dtype == torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight.to(x.dtype), eps)
    xf = x.float()
    scale = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return (xf * scale).mul_(w).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       *, unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (one rounding to the residual dtype); (norm(residual), residual)."""
    residual.add_(x)
    return rms_norm(residual, weight, eps, unit_offset=unit_offset).to(x.dtype), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # the product into silu's own output: one allocation


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


def kv_store(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, slots_valid: bool) -> None:
    """`slots_valid`: no slot is -1 (known once per step), so no masking is needed."""
    if not slots_valid:
        naive_kv_store(k, v, k_cache, v_cache, slot_mapping)
        return
    flat = (-1, *k_cache.shape[2:])
    k_cache.view(flat).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(flat).index_copy_(0, slot_mapping, v.to(v_cache.dtype))

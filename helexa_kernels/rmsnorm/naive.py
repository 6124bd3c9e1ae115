"""PyTorch references for RMSNorm: plain, with a fused residual add, and gated."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def naive_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
                   unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * w over the last dim, in fp32; `unit_offset` scales by (1 + w) instead."""
    w = weight.float() + 1.0 if unit_offset else weight.float()
    return (_normalize(x, eps) * w).to(x.dtype)


def naive_fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                             eps: float = 1e-6, *,
                             unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (rounded to the residual dtype); returns (norm(residual), residual)."""
    residual.copy_(x.float() + residual.float())
    return naive_rms_norm(residual, weight, eps, unit_offset=unit_offset).to(x.dtype), residual


def naive_gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                         eps: float = 1e-6) -> torch.Tensor:
    """rmsnorm(x) * w * silu(z): the norm after the gated delta rule (plain w, not 1 + w)."""
    return (_normalize(x, eps) * weight.float() * F.silu(z.float())).to(x.dtype)

"""PyTorch reference for the gated-MLP activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(x[..., :d]) * x[..., d:], computed in fp32."""
    d = x.shape[-1] // 2
    return (F.silu(x[..., :d].float()) * x[..., d:].float()).to(x.dtype)

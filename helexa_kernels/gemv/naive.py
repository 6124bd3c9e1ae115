"""PyTorch reference for the one-row product: fp32 sums, rounded once to x's dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T -> [1, N] in x's dtype."""
    return F.linear(x.float(), weight.float()).to(x.dtype)

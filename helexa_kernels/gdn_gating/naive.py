"""PyTorch reference for the gated DeltaNet gates: per-token decay g and update rate beta."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     dt_bias: torch.Tensor, *, softplus_beta: float = 1.0,
                     softplus_threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both fp32 [num_tokens, HV].

    A_log, dt_bias: [HV]; a, b: [num_tokens, HV]. softplus is linear past the threshold.
    """
    dt = F.softplus(a.float() + dt_bias.float(), beta=softplus_beta, threshold=softplus_threshold)
    return -A_log.float().exp() * dt, b.float().sigmoid()

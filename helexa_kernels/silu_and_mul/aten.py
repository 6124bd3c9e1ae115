"""silu(gate) * up in the model dtype in two ATen calls (fp32 inside each op): the PyTorch path's form,
tested against `naive.py`."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # the product into silu's own output: one allocation

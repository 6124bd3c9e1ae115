"""PyTorch references for the depthwise causal conv1d of the gated DeltaNet layers.

x is token-major [num_tokens, dim]; weight [dim, width] (a Conv1d weight [dim, 1, width] is
accepted too); conv_state [num_slots, dim, width - 1] holds each sequence's last width - 1
inputs, oldest first. Sequence n reads and writes slot state_indices[n]; -1 skips it (its
output rows stay zero here and are left undefined by the Triton ops). A fresh sequence
(has_initial_state[n] False) sees zeros before its first token. activation: "silu" or None.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in (None, "silu"):
        raise ValueError(f"activation {activation!r}: expected 'silu' or None")
    return F.silu(x) if activation == "silu" else x


def naive_causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        conv_state: torch.Tensor, state_indices: torch.Tensor,
                        cu_seqlens: torch.Tensor, *,
                        has_initial_state: torch.Tensor | None = None,
                        activation: str | None = "silu") -> torch.Tensor:
    """Prefill: x [num_tokens, dim] split by cu_seqlens -> [num_tokens, dim]; conv_state updated."""
    dim = x.shape[1]
    weight = weight.reshape(dim, -1).float()
    width = weight.shape[1]
    out = torch.zeros_like(x)
    bounds, slots = cu_seqlens.tolist(), state_indices.tolist()
    init = has_initial_state.tolist() if has_initial_state is not None else [True] * len(slots)
    for n, slot in enumerate(slots):
        if slot < 0:
            continue
        prev = conv_state[slot].float() if init[n] else x.new_zeros(dim, width - 1, dtype=torch.float32)
        xs = torch.cat((prev, x[bounds[n]:bounds[n + 1]].float().T), dim=1)  # [dim, width-1+len]
        y = F.conv1d(xs[None], weight[:, None, :], None if bias is None else bias.float(),
                     groups=dim)[0]  # [dim, len]
        out[bounds[n]:bounds[n + 1]] = _activate(y, activation).T.to(x.dtype)
        conv_state[slot] = xs[:, xs.shape[1] - (width - 1):].to(conv_state.dtype)
    return out


def naive_causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               conv_state: torch.Tensor, state_indices: torch.Tensor, *,
                               activation: str | None = "silu") -> torch.Tensor:
    """Decode: one token per sequence, x [num_seqs, dim] -> [num_seqs, dim]; states shift by one."""
    dim = x.shape[1]
    weight = weight.reshape(dim, -1).float()
    out = torch.zeros_like(x)
    keep = state_indices >= 0
    slots = state_indices[keep].long()
    window = torch.cat((conv_state[slots].float(), x[keep].float()[:, :, None]), dim=2)  # [n, dim, width]
    y = (window * weight).sum(-1)
    if bias is not None:
        y = y + bias.float()
    out[keep] = _activate(y, activation).to(x.dtype)
    conv_state[slots] = window[:, :, 1:].to(conv_state.dtype)
    return out

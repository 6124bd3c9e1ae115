"""Building blocks the model families share: RMSNorm, rotary embeddings, the SiLU-gated MLP.

Parameter names match HF (`weight`, `gate_proj`, ...) so checkpoints load by name.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 whatever the model dtype, as the reference implementation does.
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies [rotary_dim / 2], with linear or llama3 scaling applied."""
    dim = config.rotary_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta ** exponents)
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(is_medium, blended, scaled)
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, computed from positions on the fly."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rope_inv_freq(config)  # fail at construction, not at the first forward
        # Built lazily: the model is constructed on the meta device and weights fill it later.
        self._inv_freq: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.config).to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [num_tokens, rotary_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, rotary_dim]
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, rotary_dim]. With partial
    rotary (rotary_dim < head_dim) only the leading rotary_dim dims of each head turn."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        turned, kept = x[..., :rotary_dim], x[..., rotary_dim:]
        return torch.cat((turned * cos + rotate_half(turned) * sin, kept), dim=-1)
    return x * cos + rotate_half(x) * sin


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

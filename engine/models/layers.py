"""Building blocks the model families share: the residual stream, RMSNorm, rotary embeddings,
linear layers (`Linear`, prepacked on CPU by `engine.cpu_linear`) and packed projections, the
SiLU-gated MLP.

Parameter names match HF (`weight`, `down_proj`, ...) so checkpoints load by name, except where
projections of one input are packed into one GEMM (`PackedLinear`: `qkv_proj`, `gate_up_proj`);
the loader fills each packed weight from the checkpoint's separate tensors. The math itself runs
through `engine.ops`, which picks the Triton kernel or the PyTorch reference.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from engine import ops
from engine.config import ModelConfig
from engine.cpu_linear import Linear
from helexa_kernels.rotary.naive import build_cos_sin_cache

RESIDUAL_DTYPE = torch.float32


def residual_stream(embeddings: torch.Tensor) -> torch.Tensor:
    """The residual stream a forward pass starts from its embeddings: fp32 in every model dtype.

    The stream is the running sum of every sublayer's output; in bf16 each layer's add rounds it
    to 8 bits of mantissa. Measured on SmolLM2-135M (bf16 weights, 4 chat prompts, every
    position): fp32 keeps the mean |logit - fp32 model's logit| at 0.095 against 0.15 for a bf16
    stream, and "What is the capital of France?" then starts "The capital of France is Paris."
    as in fp32 (a bf16 stream starts "L'Étoile"; on a Sapphire Rapids it took fp32 logits as
    well, `Linear.fp32_output`). It costs one cast per layer's norm: the
    sublayers still read and write the model dtype (`RMSNorm.add_and_norm` returns the norm in x's
    dtype)."""
    return embeddings.to(RESIDUAL_DTYPE)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalized in fp32 whatever the model dtype, as the reference implementation does."""
        return ops.rms_norm(x, self.weight, self.eps)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (in place), then norm it: one pass over the residual stream."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Per-pair rotation frequencies [head_dim / 2], with linear or llama3 scaling applied."""
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
    """Rotate-half RoPE from a cos|sin table indexed by position (`ops.rotary`)."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        rope_inv_freq(config)  # fail at construction, not at the first forward
        # Built lazily: the model is constructed on the meta device and weights fill it later.
        # fp32 [max_position_embeddings, head_dim]: cos of each position's angles, then sin.
        self._cos_sin: torch.Tensor | None = None
        # (positions, their cos/sin) for the current forward (`begin_step`); every layer reuses it.
        self._step: tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        if self._cos_sin is None or self._cos_sin.device != device:
            inv_freq = rope_inv_freq(self.config).to(device)
            self._cos_sin = build_cos_sin_cache(inv_freq, self.config.max_position_embeddings)
        return self._cos_sin

    def begin_step(self, positions: torch.Tensor) -> None:
        """Called by the model at the top of each forward: gather cos/sin at this step's
        positions once, not once per layer."""
        self._step = (positions, ops.rotary_step_tables(positions, self.cos_sin_cache(positions.device)))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """(the cos|sin table, this step's gathered cos/sin when `begin_step` made them for these
        positions): what `ops.rotary` and `ops.rotary_attention` take."""
        step = self._step
        return (self.cos_sin_cache(positions.device),
                step[1] if step is not None and step[0] is positions else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor,
                positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [num_tokens, num_heads, head_dim], k [num_tokens, num_kv_heads, head_dim]."""
        return ops.rotary(q, k, positions, *self.tables(positions))


class PackedLinear(Linear):
    """Projections of the same input in one GEMM: output features are the shards side by side.

    `shards` names the checkpoint's separate projections (siblings of this module, e.g. q_proj,
    k_proj, v_proj) and their output sizes, in order; `engine.loader.load_weights` copies each
    one's weight (and bias) into its rows. One weight read and one call instead of three
    (reading the weights is most of a small-batch step on CPU).
    """

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.shards = dict(shards)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """This projection of x, cut back into its shards (views, no copy)."""
        return self(x).split(tuple(self.shards.values()), dim=-1)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate and up packed into one GEMM."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_up_proj = PackedLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))

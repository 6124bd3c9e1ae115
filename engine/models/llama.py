"""The Llama family: RMSNorm, rotary embeddings, grouped-query attention and a SiLU-gated MLP.

Module and parameter names follow HF's `LlamaForCausalLM`, so HF checkpoints (and GGUF files once
renamed) load by name. The forward pass takes one sequence's flat `input_ids`/`positions` and
keeps keys/values in whatever cache `engine.attention` manages.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import ContiguousKVCache, attention
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
    """Per-pair rotation frequencies [head_dim / 2], with linear or llama3 scaling applied."""
    dim = config.head_dim
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
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported for llama")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for rotate-half RoPE, computed from positions on the fly."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        # Built lazily: the model is constructed on the meta device and weights fill it later.
        self._inv_freq: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq = rope_inv_freq(self.config).to(positions.device)
        freqs = positions.float()[:, None] * self._inv_freq[None, :]  # [num_tokens, head_dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [num_tokens, head_dim]
        return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, head_dim]."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    return x * cos + rotate_half(x) * sin


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: ContiguousKVCache | None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q = self.q_proj(hidden).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden).view(num_tokens, self.num_kv_heads, self.head_dim)
        cos, sin = cos_sin
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = attention(q, k, v, positions, kv_cache, self.layer_idx, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, layer_idx)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor,
                cos_sin: tuple[torch.Tensor, torch.Tensor],
                kv_cache: ContiguousKVCache | None) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), positions, cos_sin, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: ContiguousKVCache | None) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        cos_sin = self.rotary_emb(positions)
        for layer in self.layers:
            hidden = layer(hidden, positions, cos_sin, kv_cache)
        return self.norm(hidden)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"llama hidden_act {config.hidden_act!r} is not supported")
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (call after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_cache: ContiguousKVCache | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """input_ids, positions: [num_tokens]. Returns logits [1, vocab] for the last position,
        or [num_tokens, vocab] with all_logits."""
        hidden = self.model(input_ids, positions, kv_cache)
        if not all_logits:
            hidden = hidden[-1:]
        return self.lm_head(hidden)

    def new_kv_cache(self, max_len: int) -> ContiguousKVCache:
        weight = self.model.embed_tokens.weight
        return ContiguousKVCache(self.config.num_hidden_layers, max_len,
                                 self.config.num_key_value_heads, self.config.head_dim,
                                 dtype=weight.dtype, device=weight.device)

"""The Llama family: RMSNorm, rotary embeddings, grouped-query attention and a SiLU-gated MLP.

Module and parameter names follow HF's `LlamaForCausalLM`, so HF checkpoints (and GGUF files once
renamed) load by name; q/k/v and gate/up are packed (`qkv_proj`, `gate_up_proj`), filled from
the separate tensors by the loader. `forward` takes a flat batch of tokens from any number of sequences and
keeps keys/values in the paged cache through `engine.runner.ops.attention`.

The residual stream travels beside the hidden states: each norm adds the previous sublayer's
output into it in place and normalizes in one pass (`RMSNorm.add_and_norm`), as the fused
kernel does on CUDA. The stream is kept in fp32 whatever the model dtype (why and what it
measured: `engine.models.layers.residual_stream`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.loading.model_config import ModelConfig
from engine.models.layers import GatedMLP, Linear, PackedLinear, RMSNorm, RotaryEmbedding, residual_stream
from engine.runner import ops
from engine.runner.attention import AttentionMetadata, KVCache


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = PackedLinear(config.hidden_size, {
            "q_proj": self.num_heads * self.head_dim, "k_proj": kv_size, "v_proj": kv_size}, bias)
        self.o_proj = Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        # Qwen3 normalizes each query and key head before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary_emb: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj.split(hidden)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        # Qwen3's norms run over head_dim, each head on its own, before RoPE.
        norms = {} if self.q_norm is None or self.k_norm is None else {
            "q_norm_weight": self.q_norm.weight, "k_norm_weight": self.k_norm.weight,
            "eps": self.q_norm.eps}
        out = ops.rotary_attention(q, k, v, positions, *rotary_emb.tables(positions), *kv_cache,
                                   meta, self.scale, **norms)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                rotary_emb: RotaryEmbedding, kv_cache: KVCache,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (this layer's MLP output, the residual stream before it is added)."""
        if residual is None:  # first layer: the embeddings start the residual stream
            residual, hidden = residual_stream(hidden), self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm.add_and_norm(hidden, residual)
        hidden = self.self_attn(hidden, positions, rotary_emb, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm.add_and_norm(hidden, residual)
        return self.mlp(hidden), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, qk_norm: bool = False) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, qk_norm)
                                    for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)  # [num_tokens, hidden_size]
        self.rotary_emb.begin_step(positions)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden, residual = layer(hidden, residual, positions, self.rotary_emb, kv_cache, meta)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class LlamaForCausalLM(nn.Module):
    family = "llama"
    qk_norm = False

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"{self.family} hidden_act {config.hidden_act!r} is not supported")
        self.config = config
        # Geometry of the paged KV cache this model expects: one (k, v) pair per layer.
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.model = LlamaModel(config, self.qk_norm)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """Share the embedding with the LM head when the config says so (call after to_empty)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[KVCache], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden states [num_tokens, hidden_size]."""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> fp32 logits [n, vocab_size]; pass only the rows that get sampled."""
        return self.lm_head.fp32_output(hidden)

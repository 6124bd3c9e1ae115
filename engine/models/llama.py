"""The Llama family: RMSNorm, rotary embeddings, grouped-query attention and a SiLU-gated MLP.

Module and parameter names follow HF's `LlamaForCausalLM`, so HF checkpoints (and GGUF files once
renamed) load by name; q/k/v and gate/up are packed (`qkv_proj`, `gate_up_proj`), filled from
the separate tensors by the loader. Built with a `Shard`, each module holds one tensor-parallel
rank's part (`engine.models.parallel_layers`: heads, MLP columns, vocabulary rows). `forward`
takes a flat batch of tokens from any number of sequences and keeps keys/values in the paged
cache through `engine.runner.ops.attention`.

The residual stream travels beside the hidden states: each norm adds the previous sublayer's
output into it in place and normalizes in one pass (`RMSNorm.add_and_norm`), as the fused
kernel does on CUDA. The stream is kept in fp32 whatever the model dtype (why and what it
measured: `engine.models.layers.residual_stream`).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.loading.model_config import ModelConfig
from engine.models.layers import RMSNorm, RotaryEmbedding, residual_stream
from engine.models.parallel_layers import (
    ColumnParallelPacked,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from engine.runner import ops
from engine.runner.attention import AttentionMetadata, KVCache


class LlamaAttention(nn.Module):
    """This rank's attention heads and KV heads (all of them at world 1)."""

    def __init__(self, config: ModelConfig, shard: Shard, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = shard.part(config.num_attention_heads)
        self.num_kv_heads = shard.part(config.num_key_value_heads)
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        bias = config.attention_bias
        kv_size = config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelPacked(config.hidden_size, {
            "q_proj": config.num_attention_heads * self.head_dim, "k_proj": kv_size, "v_proj": kv_size},
            shard, bias)
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, config.hidden_size,
                                        shard, bias=bias)
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


class LlamaMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): gate/up column-parallel, down row-parallel (one all-reduce;
    none with `reduce=False`, where the caller sums the partial outputs). `width`: the config's
    intermediate_size unless given (an MoE block's shared expert)."""

    def __init__(self, config: ModelConfig, shard: Shard, width: int | None = None, reduce: bool = True) -> None:
        super().__init__()
        width, bias = width or config.intermediate_size, config.mlp_bias
        self.gate_up_proj = ColumnParallelPacked(
            config.hidden_size, {"gate_proj": width, "up_proj": width}, shard, bias)
        self.down_proj = RowParallelLinear(width, config.hidden_size, shard, bias=bias, reduce=reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard, qk_norm: bool = False) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, shard, qk_norm)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = LlamaMLP(config, shard)

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
    def __init__(self, config: ModelConfig, shard: Shard, qk_norm: bool = False) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, shard, qk_norm)
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
    # Built as one rank's shard when given a `Shard` (engine.models.parallel_layers).
    supports_tensor_parallel = True

    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"{self.family} hidden_act {config.hidden_act!r} is not supported")
        self.config = config
        # Geometry of the paged KV cache this model expects: one (k, v) pair per layer.
        self.num_layers = config.num_hidden_layers
        shard = shard or Shard()
        self.shard = shard
        self.num_kv_heads = shard.part(config.num_key_value_heads)  # this rank's
        self.head_dim = config.head_dim
        self.model = LlamaModel(config, shard, self.qk_norm)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, shard)
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
        """[n, hidden_size] -> fp32 logits [n, vocab_size]; pass only the rows that get sampled
        (every rank of a group calls it: the head's columns are gathered)."""
        return self.lm_head.fp32_output(hidden)

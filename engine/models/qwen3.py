"""Qwen3 dense: Llama's layout plus a per-head RMSNorm on queries and keys before RoPE.

Parameter names follow HF's `Qwen3ForCausalLM` (`self_attn.q_norm`, `self_attn.k_norm`, ...).
`head_dim` comes from the config and need not be hidden_size / num_heads, so the attention
projections can be wider than the residual stream.
"""

from __future__ import annotations

from engine.loading.model_config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.models.parallel_layers import Shard


class Qwen3ForCausalLM(LlamaForCausalLM):
    family = "qwen3"
    qk_norm = True

    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        if config.extra.get("use_sliding_window"):
            raise NotImplementedError("qwen3 sliding-window attention is not supported")
        super().__init__(config, shard)

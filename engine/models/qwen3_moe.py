"""Qwen3-MoE: Qwen3 dense attention with a mixture-of-experts MLP in the sparse layers.

Layers listed in `mlp_only_layers` (or off the `decoder_sparse_step` grid) keep the dense MLP.
HF saves experts one tensor per expert; `checkpoint_targets` stacks them (see `engine.models.moe`).
"""

from __future__ import annotations

import torch

from engine.loading.model_config import ModelConfig
from engine.models.moe import CheckpointTarget, SparseMoeBlock, expert_checkpoint_targets, is_sparse_layer
from engine.models.parallel_layers import Shard
from engine.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    family = "qwen3_moe"

    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__(config, shard)
        for index, layer in enumerate(self.model.layers):
            if is_sparse_layer(config, index):
                layer.mlp = SparseMoeBlock(config, self.shard)

    @staticmethod
    def checkpoint_targets(name: str, tensor: torch.Tensor) -> list[CheckpointTarget]:
        return expert_checkpoint_targets(name, tensor) or [(name, (), tensor)]

"""Mixture-of-experts MLP shared by Qwen3-MoE and Qwen3-Next: a softmax router over all experts,
top-k with optional renormalization, and (Qwen3-Next) a shared expert behind a sigmoid gate.

Experts are stored stacked, as `experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I],
the layout of the fused MoE op. Checkpoints that save one tensor per expert
(`experts.{e}.gate_proj.weight`, ...) are sliced into those stacks by `expert_checkpoint_targets`.

Built with a `Shard`, every rank holds every expert, each cut by column as a dense MLP is
(`engine.models.parallel_layers`): its share of I in gate/up, the same rows of down. The router and
the shared expert's gate are replicated, so every rank routes alike; the routed experts' and the
shared expert's partial outputs are summed with one all-reduce.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from engine.loading.model_config import ModelConfig
from engine.models.layers import Linear
from engine.models.llama import LlamaMLP
from engine.models.parallel_layers import Shard, all_reduce
from engine.runner import ops

# A per-expert checkpoint tensor: (prefix ending in "experts."), expert index, projection.
_PER_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

CheckpointTarget = tuple[str, tuple, torch.Tensor]  # (parameter name, index into it, tensor)


def num_experts(config: ModelConfig) -> int:
    return int(config.extra.get("num_experts") or config.extra.get("num_local_experts") or 0)


def is_sparse_layer(config: ModelConfig, layer_index: int) -> bool:
    """Qwen's rule: MoE unless listed in mlp_only_layers, every decoder_sparse_step-th layer."""
    step = config.extra.get("decoder_sparse_step", 1) or 1
    return (num_experts(config) > 0 and layer_index not in config.extra.get("mlp_only_layers", [])
            and (layer_index + 1) % step == 0)


class Experts(nn.Module):
    """Every expert's MLP, this rank's columns of each (`intermediate_size` is all ranks')."""

    def __init__(self, num: int, hidden_size: int, intermediate_size: int, shard: Shard) -> None:
        super().__init__()
        width = shard.part(intermediate_size)
        self.gate_up_proj = nn.Parameter(torch.empty(num, 2 * width, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num, hidden_size, width))
        # Stacked checkpoints ([gate | up] cut each on its own) and per-expert ones.
        self.tp_dims = {"gate_up_proj": 1, "down_proj": 2} | {
            f"{e}.{proj}.weight": dim for e in range(num)
            for proj, dim in (("gate_proj", 0), ("up_proj", 0), ("down_proj", 1))}
        self.tp_sections = {"gate_up_proj": (intermediate_size, intermediate_size)}


class Router(nn.Module):
    def __init__(self, num: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num, hidden_size))


class SparseMoeBlock(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        extra = config.extra
        count, hidden = num_experts(config), config.hidden_size
        self.shard = shard or Shard()
        self.top_k = int(extra["num_experts_per_tok"])
        self.renormalize = bool(extra.get("norm_topk_prob", False))
        self.gate = Router(count, hidden)
        self.experts = Experts(count, hidden, int(extra["moe_intermediate_size"]), self.shard)
        shared = int(extra.get("shared_expert_intermediate_size") or 0)
        self.shared_expert = LlamaMLP(config, self.shard, width=shared, reduce=False) if shared else None
        self.shared_expert_gate = Linear(hidden, 1, bias=False) if shared else None

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        router_logits = hidden @ self.gate.weight.T
        weights, ids = ops.moe_routing(router_logits, self.top_k, self.renormalize)
        out = ops.fused_moe(hidden, self.experts.gate_up_proj, self.experts.down_proj, weights, ids)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            # The gate is replicated, so scaling each rank's partial output scales their sum.
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * self.shared_expert(hidden)
        return all_reduce(out, self.shard)


def expert_checkpoint_targets(name: str, tensor: torch.Tensor) -> list[CheckpointTarget] | None:
    """Where a per-expert checkpoint tensor goes in the stacked parameters; None if it is not one."""
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    prefix, expert, proj = match.group(1), int(match.group(2)), match.group(3)
    if proj == "down_proj":
        return [(f"{prefix}.down_proj", (expert,), tensor)]
    rows = tensor.shape[0]
    half = slice(0, rows) if proj == "gate_proj" else slice(rows, 2 * rows)
    return [(f"{prefix}.gate_up_proj", (expert, half), tensor)]

"""Megatron-style tensor-parallel layers: which slice of each weight a rank holds, and the one
collective that puts the slices back together.

A model built with a `Shard` of `world` ranks holds 1/world of every sharded weight:
- `ColumnParallelLinear` / `ColumnParallelPacked`: output features split (q/k/v by head, gate/up by
  MLP column); the output stays split, no communication.
- `RowParallelLinear`: input features split (o_proj, down_proj); the partial outputs are summed
  with one all-reduce. Its bias is added once: rank 0 holds it, the others hold zeros.
- `VocabParallelEmbedding`: each rank holds a contiguous range of token rows; a token outside the
  range looks up zeros, and one all-reduce sums the ranks' rows.
- `ParallelLMHead`: the same vocabulary ranges; each rank computes its logits columns and an
  all-gather gives every rank the whole row. A gathered head rather than a vocabulary-parallel
  sampler, so the sampler, grammar masks and logprobs stay as they are on one device (the gather
  moves `num_sampled × vocab` floats a step, small beside the weights).
Each parallel module names its sharded parameters in `tp_dims` (the checkpoint dimension each
is cut along; kept on the module, where it survives `to_empty`) and a row-parallel bias in
`tp_rank0_only`; a module may name a child's tensor or a checkpoint tensor it is built from
(`"conv1d.weight"`, a fused `"in_proj_qkvz.weight"`), and where that dimension is several parts
side by side (a linear-attention layer's q | k | v channels) their sizes in `tp_sections`: each
part is cut on its own. The loader reads only this rank's slice of each tensor (`split_of`,
`engine.loading.loader.shard_reader`). At world 1 every layer is its plain counterpart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.cpu.cpu_linear import Linear
from engine.frontend.protocol import EngineRefused
from engine.loading.model_config import ModelConfig
from engine.models.layers import PackedLinear


@dataclass(frozen=True, slots=True)
class Shard:
    """This process's place in a tensor-parallel group."""

    rank: int = 0
    world: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank {self.rank} is outside a group of {self.world}")

    def part(self, size: int) -> int:
        return size // self.world


def refuse_indivisible(config: ModelConfig, world: int) -> None:
    """One line naming every dimension `world` ranks cannot split evenly (KV heads fewer than the
    ranks are refused too: replicating them is not built), or the family when it has no sharded form."""
    from engine.models import get_model_class
    from engine.models.moe import is_sparse_layer

    if world == 1:
        return
    if not getattr(get_model_class(config.model_type), "supports_tensor_parallel", False):
        raise EngineRefused(f"tensor parallelism is not built for the {config.model_type} family yet")
    dims = {"num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": config.num_key_value_heads,
            "intermediate_size": config.intermediate_size, "vocab_size": config.vocab_size}
    # Mixture-of-experts layers split every expert's MLP (and the shared expert's) by column.
    if any(is_sparse_layer(config, i) for i in range(config.num_hidden_layers)):
        dims |= {name: int(config.extra[name]) for name in ("moe_intermediate_size",
                 "shared_expert_intermediate_size") if config.extra.get(name)}
    # The hybrid families' linear-attention layers split by key and value head.
    dims |= {name: int(config.extra[name]) for name in ("linear_num_key_heads", "linear_num_value_heads")
             if "linear_attention" in config.layer_types and name in config.extra}
    bad = [f"{name} {size}" for name, size in dims.items() if size % world]
    if config.num_key_value_heads < world:
        # Replicating KV heads across ranks (each rank a copy of one head) is not built: each
        # rank's KV cache would shrink by fewer than N, and a copy's layout differs from a shard's.
        bad[bad.index(f"num_key_value_heads {config.num_key_value_heads}")] += (
            " (fewer KV heads than ranks: replicating KV heads is not built)")
    if bad:
        raise EngineRefused(f"tensor_parallel {world} does not divide {', '.join(bad)} of this model")


class Split(NamedTuple):
    """How the ranks share one tensor."""

    dim: int | None  # the dimension it is cut along; None: every rank holds all of it
    rank0_only: bool = False  # rank 0 holds its values, the others zeros (a row-parallel bias)
    sections: tuple[int, ...] = ()  # `dim` is these parts side by side, each cut on its own


def split_of(model: nn.Module, name: str) -> Split:
    """How `name` (a parameter's, or a checkpoint tensor's a module declares) is split: the nearest
    module on its path that declares the rest of the name in `tp_dims` or `tp_rank0_only` says."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        try:
            module = model.get_submodule(".".join(parts[:cut]))
        except AttributeError:
            continue
        key = ".".join(parts[cut:])
        dims: dict[str, int] = getattr(module, "tp_dims", {})
        if key in getattr(module, "tp_rank0_only", ()):
            return Split(None, rank0_only=True)
        if key in dims:
            return Split(dims[key], sections=getattr(module, "tp_sections", {}).get(key, ()))
    return Split(None)


def shard_slices(shape: list[int], split: Split, shard: Shard) -> list[tuple[slice, ...]]:
    """The index of this rank's part of a tensor of `shape` split as `split` (one per section,
    to be joined along `split.dim`)."""
    dim = split.dim
    assert dim is not None
    sections = split.sections or (shape[dim],)
    if sum(sections) != shape[dim]:
        raise ValueError(f"sections {sections} do not make up dimension {dim} of shape {tuple(shape)}")
    slices, offset = [], 0
    for size in sections:
        part = size // shard.world
        index = [slice(None)] * len(shape)
        index[dim] = slice(offset + shard.rank * part, offset + (shard.rank + 1) * part)
        slices.append(tuple(index))
        offset += size
    return slices


def all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    if shard.world > 1:
        dist.all_reduce(x)
    return x


class ColumnParallelLinear(Linear):
    def __init__(self, in_features: int, out_features: int, shard: Shard, bias: bool = False) -> None:
        super().__init__(in_features, shard.part(out_features), bias=bias)
        self.tp_dims = {"weight": 0, "bias": 0}


class ColumnParallelPacked(PackedLinear):
    """Packed projections (q/k/v, gate/up) each split by output feature: this rank's rows of each."""

    def __init__(self, in_features: int, shards: dict[str, int], shard: Shard, bias: bool = False) -> None:
        super().__init__(in_features, {name: shard.part(rows) for name, rows in shards.items()}, bias)
        self.tp_dims = {"weight": 0, "bias": 0}


class RowParallelLinear(Linear):
    """`reduce=False`: the caller sums the partial outputs, with others' in one all-reduce (an MoE
    block's shared expert beside its routed experts)."""

    def __init__(self, in_features: int, out_features: int, shard: Shard, bias: bool = False,
                 reduce: bool = True) -> None:
        super().__init__(shard.part(in_features), out_features, bias=bias)
        self.shard = shard
        self.reduce = reduce
        self.tp_dims = {"weight": 1}
        self.tp_rank0_only = {"bias"}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return all_reduce(out, self.shard) if self.reduce else out


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        super().__init__(shard.part(vocab_size), hidden_size)
        self.shard = shard
        self.vocab_start = shard.rank * self.num_embeddings
        self.tp_dims = {"weight": 0}

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard.world == 1:
            return super().forward(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        hidden.masked_fill_(outside.unsqueeze(-1), 0)  # [num_tokens, hidden_size]
        return all_reduce(hidden, self.shard)


class ParallelLMHead(Linear):
    def __init__(self, hidden_size: int, vocab_size: int, shard: Shard) -> None:
        super().__init__(hidden_size, shard.part(vocab_size), bias=False)
        self.shard = shard
        self.tp_dims = {"weight": 0}

    def fp32_output(self, x: torch.Tensor) -> torch.Tensor:
        local = super().fp32_output(x)  # [n, vocab_size / world]
        if self.shard.world == 1:
            return local
        return all_gather(local.contiguous(), self.shard)


def all_gather(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Every rank's `x` side by side along the last dimension. Gloo has no all-gather of CUDA
    tensors (it serves several ranks on one GPU, where NCCL refuses): those go by way of the host."""
    through_host = x.is_cuda and dist.get_backend() == "gloo"
    local = x.cpu() if through_host else x
    parts = [torch.empty_like(local) for _ in range(shard.world)]
    dist.all_gather(parts, local)
    return torch.cat(parts, dim=-1).to(x.device)


def rank_bytes(model: nn.Module) -> int:
    """Bytes of this rank's weights (tied parameters once)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())

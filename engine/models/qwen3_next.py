"""Hybrid Qwen3-Next / Qwen3.5: gated DeltaNet (linear attention) layers between gated full-attention
layers, `config.layer_types` saying which is which.

- Full attention: Qwen3's attention with q_proj twice as wide (per head [query | gate]), output
  multiplied by sigmoid(gate); q/k norms with (1 + w) weights; partial rotary. K/V in the paged cache.
- Linear attention: one projection to q|k|v (the causal conv's channels), z (the output gate) and
  b, a (update rate and decay) per value head; causal depthwise conv + SiLU; the gated delta rule
  over a per-sequence recurrent state; a gated RMSNorm; out_proj. Conv and recurrent states live in
  slots of `engine.runner.state_cache.LinearStateCache`, one slot per sequence for its whole life.
- MLP: MoE (with a shared expert) where the config has experts, dense otherwise (Qwen3.5).
- Every other norm scales by (1 + w).

Built with a `Shard` (`engine.models.parallel_layers`), each rank holds its share of the heads:
full attention as Llama's (query and KV heads split, o_proj row-parallel); linear attention split by
key head, each rank taking whole key-head groups (its key heads and the value heads they serve):
the q, k and v parts of the conv channels each cut on their own (`tp_sections`), z, b, a, A_log and
dt_bias by value head, the gated norm (one head's width) whole, out_proj row-parallel; the dense MLP
column/row-parallel, MoE layers by column of every expert (`engine.models.moe`). So each rank's
conv and recurrent state hold its heads only.

Qwen3-Next checkpoints fuse q,k,v,z and b,a per key-head group (`in_proj_qkvz`, `in_proj_ba`);
`checkpoint_targets` de-interleaves them into Qwen3.5's separate layout, and the loader packs
those (`in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`) into this module's one `in_proj`,
as it packs q/k/v into `qkv_proj` and gate/up into `gate_up_proj`.
Qwen3.5 checkpoints nest the language model under `model.language_model.`.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.loading.model_config import ModelConfig
from engine.models.layers import RotaryEmbedding, residual_stream
from engine.models.llama import LlamaMLP
from engine.models.moe import CheckpointTarget, SparseMoeBlock, expert_checkpoint_targets, is_sparse_layer
from engine.models.parallel_layers import (
    ColumnParallelPacked,
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    VocabParallelEmbedding,
)
from engine.runner import ops
from engine.runner.attention import AttentionMetadata, KVCache
from engine.runner.state_cache import HybridCaches, LinearStateShape


class UnitOffsetRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + w): weights are stored centred on zero."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps, unit_offset=True)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (in place), then norm it in x's dtype: see RMSNorm.add_and_norm."""
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps, unit_offset=True)


class GatedAttention(nn.Module):
    """This rank's query and KV heads (all of them at world 1)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.num_heads = shard.part(config.num_attention_heads)
        self.num_kv_heads = shard.part(config.num_key_value_heads)
        self.head_dim = config.head_dim
        self.scale = self.head_dim ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        # q_proj is twice as wide: per head [query | gate], so a cut by head keeps whole pairs.
        self.qkv_proj = ColumnParallelPacked(hidden, {"q_proj": 2 * q_size, "k_proj": kv_size, "v_proj": kv_size},
                                             shard, bias)
        self.o_proj = RowParallelLinear(q_size, hidden, shard, bias=bias)
        self.q_norm = UnitOffsetRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = UnitOffsetRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rotary_emb: RotaryEmbedding,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q_gate, k, v = self.qkv_proj.split(hidden)
        q, gate = q_gate.view(num_tokens, self.num_heads, 2 * self.head_dim).chunk(2, -1)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = ops.rotary_attention(q, k, v, positions, *rotary_emb.tables(positions), *kv_cache,
                                   meta, self.scale, q_norm_weight=self.q_norm.weight,
                                   k_norm_weight=self.k_norm.weight, eps=self.q_norm.eps,
                                   unit_offset=True)
        out = out * torch.sigmoid(gate)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class GatedDeltaNet(nn.Module):
    """This rank's linear-attention heads: whole key-head groups (all of them at world 1)."""

    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        extra = config.extra
        all_k_heads, all_v_heads = int(extra["linear_num_key_heads"]), int(extra["linear_num_value_heads"])
        self.num_k_heads, self.num_v_heads = shard.part(all_k_heads), shard.part(all_v_heads)
        self.k_dim = int(extra["linear_key_head_dim"])
        self.v_dim = int(extra["linear_value_head_dim"])
        self.conv_kernel = int(extra.get("linear_conv_kernel_dim", 4))
        self.eps = config.rms_norm_eps
        key_size, value_size = all_k_heads * self.k_dim, all_v_heads * self.v_dim  # all ranks'
        channels = (key_size, key_size, value_size)  # q | k | v
        self.conv_dim = shard.part(sum(channels))  # this rank's
        hidden = config.hidden_size
        # Every input projection in one GEMM: q|k|v (the conv's channels), z, b, a.
        self.in_proj = ColumnParallelPacked(hidden, {
            "in_proj_qkv": sum(channels), "in_proj_z": value_size,
            "in_proj_b": all_v_heads, "in_proj_a": all_v_heads}, shard)
        # Depthwise conv weight [conv_dim, 1, kernel]; named as in the checkpoints.
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_kernel, groups=self.conv_dim,
                                bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.num_v_heads))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.ones(self.v_dim))  # plain w: the gated norm
        self.out_proj = RowParallelLinear(value_size, hidden, shard)
        # By head (see the module docstring); Qwen3-Next's fused tensors are grouped per key head,
        # so a plain cut of them gives whole groups.
        self.tp_dims = {"conv1d.weight": 0, "dt_bias": 0, "A_log": 0, "in_proj_qkv.weight": 0,
                        "in_proj_qkvz.weight": 0, "in_proj_ba.weight": 0}
        self.tp_sections = {"conv1d.weight": channels, "in_proj_qkv.weight": channels}

    def forward(self, hidden: torch.Tensor, conv_state: torch.Tensor, recurrent_state: torch.Tensor,
                slot_indices: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        mixed, z, b, a = self.in_proj.split(hidden)  # mixed: [num_tokens, conv_dim]
        if meta.is_pure_decode:
            mixed = ops.causal_conv1d_update(mixed, self.conv1d.weight, None, conv_state, slot_indices)
        else:
            mixed = ops.causal_conv1d(mixed, self.conv1d.weight, None, conv_state, slot_indices,
                                      meta.query_start_loc, has_initial_state=_has_initial_state(meta))
        key_size = self.num_k_heads * self.k_dim
        q, k, v = mixed.split((key_size, key_size, self.num_v_heads * self.v_dim), dim=-1)
        q = q.reshape(num_tokens, self.num_k_heads, self.k_dim)
        k = k.reshape(num_tokens, self.num_k_heads, self.k_dim)
        v = v.reshape(num_tokens, self.num_v_heads, self.v_dim)
        g, beta = ops.gdn_gating(self.A_log, a, b, self.dt_bias)
        if meta.is_pure_decode:
            out = ops.recurrent_gated_delta_rule(q, k, v, g, beta, recurrent_state, slot_indices)
        else:
            out = ops.chunk_gated_delta_rule(q, k, v, g, beta, recurrent_state, slot_indices,
                                             meta.query_start_loc, has_initial_state=_has_initial_state(meta))
        z = z.reshape(num_tokens * self.num_v_heads, self.v_dim)
        out = ops.gated_rms_norm(out.reshape(-1, self.v_dim), z, self.norm.weight, self.eps)
        return self.out_proj(out.reshape(num_tokens, self.num_v_heads * self.v_dim))


def _has_initial_state(meta: AttentionMetadata) -> torch.Tensor:
    """[num_seqs] bool: the sequence computed tokens in an earlier step, so its slot holds its state."""
    query_lens = meta.query_start_loc[1:] - meta.query_start_loc[:-1]
    return meta.seq_lens - query_lens > 0


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int, shard: Shard) -> None:
        super().__init__()
        self.is_linear = config.layer_types[index] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(config, shard)
        else:
            self.self_attn = GatedAttention(config, shard)
        if is_sparse_layer(config, index):
            self.mlp: nn.Module = SparseMoeBlock(config, shard)
        else:
            self.mlp = LlamaMLP(config, shard)
        self.input_layernorm = UnitOffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = UnitOffsetRMSNorm(config.hidden_size, config.rms_norm_eps)


class HybridModel(nn.Module):
    def __init__(self, config: ModelConfig, shard: Shard) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, shard)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i, shard)
                                    for i in range(config.num_hidden_layers))
        self.norm = UnitOffsetRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: HybridCaches,
                meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        self.rotary_emb.begin_step(positions)
        slots = caches.slot_indices
        kv_index = linear_index = 0
        residual = None  # fp32 whatever the model dtype, as in Llama (layers.residual_stream)
        for layer in self.layers:
            if residual is None:
                residual, normed = residual_stream(hidden), layer.input_layernorm(hidden)
            else:
                normed, residual = layer.input_layernorm.add_and_norm(hidden, residual)
            if layer.is_linear:
                states = caches.states
                mixed = layer.linear_attn(normed, states.conv[linear_index],
                                          states.recurrent[linear_index], slots, meta)
                linear_index += 1
            else:
                mixed = layer.self_attn(normed, positions, self.rotary_emb, caches.kv[kv_index], meta)
                kv_index += 1
            normed, residual = layer.post_attention_layernorm.add_and_norm(mixed, residual)
            hidden = layer.mlp(normed)
        if residual is None:
            return self.norm(hidden)
        return self.norm.add_and_norm(hidden, residual)[0]


class Qwen3NextForCausalLM(nn.Module):
    family = "qwen3_next"
    # Built as one rank's shard when given a `Shard` (engine.models.parallel_layers).
    supports_tensor_parallel = True

    def __init__(self, config: ModelConfig, shard: Shard | None = None) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"{self.family} hidden_act {config.hidden_act!r} is not supported")
        self.config = config
        # The paged KV cache covers the full-attention layers only.
        self.num_layers = config.num_attention_layers
        shard = shard or Shard()
        self.shard = shard
        self.num_kv_heads = shard.part(config.num_key_value_heads)  # this rank's
        self.head_dim = config.head_dim
        self.model = HybridModel(config, shard)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size, shard)
        linear = [layer.linear_attn for layer in self.model.layers if layer.is_linear]
        # Per-sequence state the engine keeps in slots, this rank's heads (zero layers still takes
        # HybridCaches).
        self.linear_state_shape = LinearStateShape(
            num_layers=len(linear), conv_dim=linear[0].conv_dim if linear else 1,
            conv_kernel=linear[0].conv_kernel if linear else 2,
            num_v_heads=linear[0].num_v_heads if linear else 1,
            k_dim=linear[0].k_dim if linear else 1, v_dim=linear[0].v_dim if linear else 1)
        self.tie_weights()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: HybridCaches,
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] -> hidden [num_tokens, hidden_size]; `caches.slot_indices`
        gives each sequence's state slot, in the order of `meta`."""
        return self.model(input_ids, positions, caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.fp32_output(hidden)

    def checkpoint_name(self, name: str) -> str:
        """A checkpoint tensor's name as this module names it (before any split or fuse)."""
        return name

    def checkpoint_targets(self, name: str, tensor: torch.Tensor) -> list[CheckpointTarget]:
        if name.startswith("mtp."):
            return []  # multi-token-prediction head: not used for decoding here
        experts = expert_checkpoint_targets(name, tensor)
        if experts is not None:
            return experts
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            return self._split_qkvz(name.removesuffix("in_proj_qkvz.weight"), tensor)
        if name.endswith("linear_attn.in_proj_ba.weight"):
            return self._split_ba(name.removesuffix("in_proj_ba.weight"), tensor)
        return [(name, (), tensor)]

    def _split_qkvz(self, prefix: str, tensor: torch.Tensor) -> list[CheckpointTarget]:
        """Rows grouped per key head as [q | k | v of its value heads | z of its value heads]
        (this rank's groups: as many as the tensor holds)."""
        extra = self.config.extra
        nk, k_dim = extra["linear_num_key_heads"], extra["linear_key_head_dim"]
        per_group_v = extra["linear_num_value_heads"] // nk * extra["linear_value_head_dim"]
        grouped = tensor.reshape(-1, 2 * k_dim + 2 * per_group_v, tensor.shape[-1])
        q, k, v, z = grouped.split((k_dim, k_dim, per_group_v, per_group_v), dim=1)
        hidden = tensor.shape[-1]
        qkv = torch.cat([part.reshape(-1, hidden) for part in (q, k, v)])
        return [(prefix + "in_proj_qkv.weight", (), qkv),
                (prefix + "in_proj_z.weight", (), z.reshape(-1, hidden))]

    def _split_ba(self, prefix: str, tensor: torch.Tensor) -> list[CheckpointTarget]:
        """Rows grouped per key head as [b of its value heads | a of its value heads] (this rank's
        groups)."""
        extra = self.config.extra
        per_group = extra["linear_num_value_heads"] // extra["linear_num_key_heads"]
        b, a = tensor.reshape(-1, 2 * per_group, tensor.shape[-1]).split((per_group, per_group), dim=1)
        hidden = tensor.shape[-1]
        return [(prefix + "in_proj_b.weight", (), b.reshape(-1, hidden)),
                (prefix + "in_proj_a.weight", (), a.reshape(-1, hidden))]


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    """The text part of Qwen3.5: dense MLPs, separate projections, weights under
    `model.language_model.`; the vision tower's weights are skipped."""

    family = "qwen3_5"

    def checkpoint_name(self, name: str) -> str:
        if name.startswith("model.language_model."):
            return "model." + name.removeprefix("model.language_model.")
        return name

    def checkpoint_targets(self, name: str, tensor: torch.Tensor) -> list[CheckpointTarget]:
        if name.startswith("model.visual."):
            return []
        return super().checkpoint_targets(self.checkpoint_name(name), tensor)

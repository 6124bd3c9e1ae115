"""The memory of a hybrid model's per-sequence state, beside the paged KV of its attention layers.

Every linear-attention layer has a conv state [num_slots, conv_dim, kernel - 1] (model dtype: the
last inputs of the causal conv) and a recurrent state [num_slots, v_heads, k_dim, v_dim] in fp32
(the delta-rule memory, which drifts if kept in bf16). Slot ids come from `StateSlotPool`; a slot is
never cleared on reuse, because a sequence with no computed tokens starts from zeros
(`has_initial_state` False) and overwrites its slot. In a tensor-parallel group each rank's shape
is its own heads' (`conv_dim` and `num_v_heads` 1/N of the model's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.runner.step_metadata import KVCache


@dataclass(frozen=True, slots=True)
class LinearStateShape:
    num_layers: int
    conv_dim: int
    conv_kernel: int
    num_v_heads: int
    k_dim: int
    v_dim: int

    def bytes_per_slot(self, dtype: torch.dtype) -> int:
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty((), dtype=dtype).element_size()
        recurrent = self.num_v_heads * self.k_dim * self.v_dim * 4
        return self.num_layers * (conv + recurrent)


class LinearStateCache:
    def __init__(self, shape: LinearStateShape, num_slots: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.shape = shape
        self.num_slots = num_slots
        self.conv = [torch.zeros(num_slots, shape.conv_dim, shape.conv_kernel - 1, dtype=dtype,
                                 device=device) for _ in range(shape.num_layers)]
        self.recurrent = [torch.zeros(num_slots, shape.num_v_heads, shape.k_dim, shape.v_dim,
                                      dtype=torch.float32, device=device)
                          for _ in range(shape.num_layers)]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self.conv, *self.recurrent))


@dataclass(slots=True)
class HybridCaches:
    """What a hybrid model's forward takes in place of a plain list of KV caches."""

    kv: list[KVCache]  # one (k_cache, v_cache) per full-attention layer, in layer order
    states: LinearStateCache
    # [num_seqs] int32: the state slot of each sequence in this step's batch, in batch order.
    slot_indices: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))

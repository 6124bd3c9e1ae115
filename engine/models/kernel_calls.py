"""The call sites through which the hybrid and MoE model files reach kernels.

Each function is a thin, named entry point onto one op. Today they run the PyTorch references in
`kernels/<op>/naive.py`; when `engine.ops` picks an implementation per device (Triton on CUDA),
only the bodies here change, never the model files.
"""

from __future__ import annotations

import torch

from kernels.causal_conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update
from kernels.gated_delta_rule.naive import (
    naive_chunk_gated_delta_rule,
    naive_recurrent_gated_delta_rule,
)
from kernels.gdn_gating.naive import naive_gdn_gating
from kernels.moe.naive import naive_fused_moe, naive_moe_routing
from kernels.rmsnorm.naive import naive_gated_rms_norm, naive_rms_norm


def rms_norm_unit_offset(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * (1 + w) in fp32: the zero-centred norm weights of Qwen3-Next / Qwen3.5."""
    return naive_rms_norm(x, weight, eps, unit_offset=True)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return naive_gated_rms_norm(x, z, weight, eps)


def conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                   state_indices: torch.Tensor, cu_seqlens: torch.Tensor,
                   has_initial_state: torch.Tensor) -> torch.Tensor:
    return naive_causal_conv1d(x, weight, None, conv_state, state_indices, cu_seqlens,
                               has_initial_state=has_initial_state, activation="silu")


def conv1d_decode(x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor,
                  state_indices: torch.Tensor) -> torch.Tensor:
    return naive_causal_conv1d_update(x, weight, None, conv_state, state_indices, activation="silu")


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return naive_gdn_gating(A_log, a, b, dt_bias)


def gated_delta_rule_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                             beta: torch.Tensor, state: torch.Tensor, state_indices: torch.Tensor,
                             cu_seqlens: torch.Tensor,
                             has_initial_state: torch.Tensor) -> torch.Tensor:
    return naive_chunk_gated_delta_rule(q, k, v, g, beta, state, state_indices, cu_seqlens,
                                        has_initial_state=has_initial_state)


def gated_delta_rule_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                            beta: torch.Tensor, state: torch.Tensor,
                            state_indices: torch.Tensor) -> torch.Tensor:
    return naive_recurrent_gated_delta_rule(q, k, v, g, beta, state, state_indices)


def moe_routing(router_logits: torch.Tensor, top_k: int,
                renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return naive_moe_routing(router_logits, top_k, renormalize)


def fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
              topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    return naive_fused_moe(hidden, w13, w2, topk_weights, topk_ids)

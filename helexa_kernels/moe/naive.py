"""PyTorch references for mixture-of-experts: routing, the grouped matmul, the whole MoE MLP.

Routing (Qwen3-MoE / Qwen3-Next): softmax over all experts in fp32, keep the top k, optionally
renormalize the kept weights to sum to one. Experts are SiLU-gated MLPs stacked as
w13 [E, 2 * I, H] (gate rows, then up rows) and w2 [E, H, I].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_moe_routing(router_logits: torch.Tensor, top_k: int,
                      renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [num_tokens, E] -> (topk_weights fp32 [num_tokens, k], topk_ids int32)."""
    probs = router_logits.float().softmax(dim=-1)
    weights, ids = probs.topk(top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)


def naive_grouped_matmul(x: torch.Tensor, w: torch.Tensor,
                         expert_offsets: torch.Tensor) -> torch.Tensor:
    """Rows expert_offsets[e]:expert_offsets[e + 1] of x [M, K] times w[e]^T, w [E, N, K] -> [M, N]."""
    out = x.new_empty(x.shape[0], w.shape[1])
    bounds = expert_offsets.tolist()
    for e in range(w.shape[0]):
        rows = slice(bounds[e], bounds[e + 1])
        out[rows] = (x[rows].float() @ w[e].float().T).to(x.dtype)
    return out


def naive_fused_moe(hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                    topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]), hidden [T, H] -> [T, H]."""
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    for e in range(w13.shape[0]):
        token, slot = (topk_ids == e).nonzero(as_tuple=True)
        if token.numel() == 0:
            continue
        gate, up = (hidden[token].float() @ w13[e].float().T).chunk(2, dim=-1)
        y = (F.silu(gate) * up) @ w2[e].float().T  # [n, H]
        out.index_add_(0, token, y * topk_weights[token, slot].float()[:, None])
    return out.to(hidden.dtype)

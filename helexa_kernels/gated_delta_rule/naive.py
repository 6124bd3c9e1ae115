"""PyTorch references for the gated delta rule: token by token, and chunk by chunk.

Per value head, with state S [K, V] (fp32) and token inputs q, k [K], v [V], g, beta:

    S <- exp(g) * S;  delta = beta * (v - S^T k);  S <- S + k delta^T;  o = S^T q

q and k are L2-normalized inside the op when `use_qk_l2norm` (x / sqrt(sum x^2 + 1e-6), as
the HF models do), then q is scaled by `scale` (default 1 / sqrt(K)). Key heads are shared
GQA-style: value head h reads q/k head h // (HV // HK).

Both functions share one signature with the Triton ops. Tokens are flat ([num_tokens, ...])
and split into sequences by cu_seqlens (None: every token is its own sequence, i.e. decode).
Sequence n starts from state[state_indices[n]] (zeros where has_initial_state[n] is False) and
writes its final state back there; a slot index of -1 skips the sequence (its rows of the output
stay zero here and are left undefined by the Triton ops).

The chunked form: within a chunk of C tokens with inclusive cumulative decay G_i, unrolling
the recurrence from the chunk's initial state S0 gives deltas that solve a unit lower
triangular system,

    (I + L) delta = beta * (v - exp(G) * (K S0)),   L_ij = beta_i exp(G_i - G_j) k_i.k_j  (j < i)
    o = exp(G) * (Q S0) + [(Q K^T) * exp(G_i - G_j)]_{j <= i} delta
    S_end = exp(G_C) S0 + (K * exp(G_C - G))^T delta
"""

from __future__ import annotations

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prepare(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None,
             use_qk_l2norm: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 q, k expanded to the value heads: [num_tokens, HV, K]."""
    q, k = q.float(), k.float()
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * (scale if scale is not None else q.shape[-1] ** -0.5)
    group = v.shape[1] // k.shape[1]
    return q.repeat_interleave(group, dim=1), k.repeat_interleave(group, dim=1)


def _sequences(num_tokens: int, state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None,
               has_initial_state: torch.Tensor | None):
    bounds = cu_seqlens.tolist() if cu_seqlens is not None else list(range(num_tokens + 1))
    slots = state_indices.tolist()
    init = has_initial_state.tolist() if has_initial_state is not None else [True] * len(slots)
    for n, slot in enumerate(slots):
        if slot >= 0:
            yield bounds[n], bounds[n + 1], slot, init[n]


def naive_recurrent_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
    scale: float | None = None, use_qk_l2norm: bool = True,
    has_initial_state: torch.Tensor | None = None,
) -> torch.Tensor:
    """q, k [num_tokens, HK, K]; v [num_tokens, HV, V]; g, beta [num_tokens, HV];
    state [num_slots, HV, K, V] fp32, updated in place -> o [num_tokens, HV, V]."""
    q, k = _prepare(q, k, v, scale, use_qk_l2norm)
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for bos, eos, slot, use_init in _sequences(q.shape[0], state_indices, cu_seqlens,
                                                has_initial_state):
        s = state[slot].float().clone() if use_init else torch.zeros_like(state[slot])
        for t in range(bos, eos):
            s = s * g[t].float().exp()[:, None, None]  # [HV, K, V]
            kv = torch.einsum("hkv,hk->hv", s, k[t])
            delta = beta[t].float()[:, None] * (v[t].float() - kv)  # [HV, V]
            s = s + k[t][:, :, None] * delta[:, None, :]
            o[t] = torch.einsum("hkv,hk->hv", s, q[t])
        state[slot] = s
    return o.to(v.dtype)


def naive_chunk_gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, state_indices: torch.Tensor, cu_seqlens: torch.Tensor | None = None, *,
    scale: float | None = None, use_qk_l2norm: bool = True,
    has_initial_state: torch.Tensor | None = None, chunk_size: int = 64,
) -> torch.Tensor:
    """Same contract as `naive_recurrent_gated_delta_rule`, computed chunk by chunk."""
    q, k = _prepare(q, k, v, scale, use_qk_l2norm)
    o = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for bos, eos, slot, use_init in _sequences(q.shape[0], state_indices, cu_seqlens,
                                                has_initial_state):
        s = state[slot].float().clone() if use_init else torch.zeros_like(state[slot])
        for start in range(bos, eos, chunk_size):
            end = min(start + chunk_size, eos)
            # [HV, C, K] / [HV, C, V] / [HV, C]
            q_c, k_c = q[start:end].transpose(0, 1), k[start:end].transpose(0, 1)
            v_c = v[start:end].float().transpose(0, 1)
            beta_c = beta[start:end].float().transpose(0, 1)
            g_cum = g[start:end].float().transpose(0, 1).cumsum(-1)
            size = end - start
            causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
            # exp(G_i - G_j) where j <= i; the masked exponent keeps the upper part from overflowing.
            decay = torch.where(causal, g_cum[:, :, None] - g_cum[:, None, :], -torch.inf).exp()
            strict = (beta_c[:, :, None] * (k_c @ k_c.transpose(1, 2)) * decay).tril(-1)
            rhs = beta_c[:, :, None] * (v_c - g_cum.exp()[:, :, None] * (k_c @ s))
            eye = torch.eye(size, device=q.device)
            delta = torch.linalg.solve_triangular(eye + strict, rhs, upper=False,
                                                  unitriangular=True)
            o_c = g_cum.exp()[:, :, None] * (q_c @ s) + ((q_c @ k_c.transpose(1, 2)) * decay) @ delta
            o[start:end] = o_c.transpose(0, 1)
            g_last = g_cum[:, -1:]  # [HV, 1]
            s = (g_last.exp()[:, :, None] * s
                 + (k_c * (g_last - g_cum).exp()[:, :, None]).transpose(1, 2) @ delta)
        state[slot] = s
    return o.to(v.dtype)

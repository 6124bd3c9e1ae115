"""GDN gating in Triton: both gates of a token's value heads in one elementwise pass."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def gdn_gating_fwd_kernel(
    A_log, a, b, dt_bias,  # [HV], [T, HV] (strided), [T, HV] (strided), [HV]
    g, beta,  # [T, HV] fp32
    stride_at, stride_bt, HV,
    softplus_beta, softplus_threshold,
    BH: tl.constexpr,
):
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    m_h = o_h < HV
    b_a = tl.load(a + i_t * stride_at + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_b = tl.load(b + i_t * stride_bt + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_A = tl.load(A_log + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_x = b_a + tl.load(dt_bias + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_bx = softplus_beta * b_x
    # Past the threshold softplus is x itself (and exp would overflow).
    b_dt = tl.where(b_bx > softplus_threshold, b_x,
                    tl.log(1.0 + tl.exp(tl.minimum(b_bx, softplus_threshold))) / softplus_beta)
    tl.store(g + i_t * HV + o_h, -tl.exp(b_A) * b_dt, mask=m_h)
    tl.store(beta + i_t * HV + o_h, tl.sigmoid(b_b), mask=m_h)


def gdn_gating(A_log: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dt_bias: torch.Tensor, *,
               softplus_beta: float = 1.0,
               softplus_threshold: float = 20.0) -> tuple[torch.Tensor, torch.Tensor]:
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), both fp32 [num_tokens, HV].

    A_log, dt_bias: [HV]; a, b: [num_tokens, HV] (row-strided views are fine).
    """
    T, HV = a.shape
    if b.shape != a.shape or A_log.shape != (HV,) or dt_bias.shape != (HV,):
        raise ValueError("a, b [num_tokens, HV]; A_log, dt_bias [HV]")
    if a.stride(-1) != 1 or b.stride(-1) != 1:
        raise ValueError("a and b need a contiguous last dim")
    g = torch.empty(T, HV, dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    if T:
        BH = min(1024, triton.next_power_of_2(HV))
        gdn_gating_fwd_kernel[(T, triton.cdiv(HV, BH))](
            A_log, a, b, dt_bias, g, beta, a.stride(0), b.stride(0), HV, softplus_beta,
            softplus_threshold, BH=BH,
        )
    return g, beta

"""RMSNorm in Triton: one program per row, fp32 accumulation, one rounding at the store.

One kernel covers the three variants through constexpr flags: a fused residual add (the sum is
rounded to the residual dtype before it is normalized, so fused and unfused layers agree), the
(1 + w) weight of Qwen3-Next/Qwen3.5, and the output gate silu(z) of the gated delta rule's norm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def rms_norm_fwd_kernel(
    x,  # [num_rows, N]
    w,  # [N]
    o,  # [num_rows, N]
    res,  # [num_rows, N] residual in, overwritten with x + residual (HAS_RESIDUAL)
    z,  # [num_rows, N] gate (HAS_GATE)
    N,
    eps,
    UNIT_OFFSET: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_GATE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    i_row = tl.program_id(0).to(tl.int64)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    p_x = x + i_row * N + o_n
    b_x = tl.load(p_x, mask=m_n, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        p_res = res + i_row * N + o_n
        b_sum = b_x + tl.load(p_res, mask=m_n, other=0.0).to(tl.float32)
        tl.store(p_res, b_sum.to(res.dtype.element_ty), mask=m_n)
        # Normalize what the residual stream now holds, rounding included.
        b_x = b_sum.to(res.dtype.element_ty).to(tl.float32)
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=0) / N + eps)
    b_w = tl.load(w + o_n, mask=m_n, other=0.0).to(tl.float32)
    if UNIT_OFFSET:
        b_w = b_w + 1.0
    b_o = b_x * b_rstd * b_w
    if HAS_GATE:
        b_z = tl.load(z + i_row * N + o_n, mask=m_n, other=0.0).to(tl.float32)
        b_o = b_o * b_z * tl.sigmoid(b_z)
    tl.store(o + i_row * N + o_n, b_o.to(o.dtype.element_ty), mask=m_n)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool,
            residual: torch.Tensor | None, z: torch.Tensor | None) -> torch.Tensor:
    N = x.shape[-1]
    if weight.shape != (N,):
        raise ValueError(f"weight {tuple(weight.shape)} does not match hidden size {N}")
    x2 = x.reshape(-1, N).contiguous()  # [num_rows, N]
    o = torch.empty_like(x2)
    rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, weight, o, residual if residual is not None else x2, z if z is not None else x2,
        N, eps, UNIT_OFFSET=unit_offset, HAS_RESIDUAL=residual is not None,
        HAS_GATE=z is not None, BLOCK_N=triton.next_power_of_2(N),
        num_warps=8 if N >= 4096 else 4,
    )
    return o.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *,
             unit_offset: bool = False) -> torch.Tensor:
    """x / rms(x) * w over the last dim; `unit_offset` scales by (1 + w) instead."""
    return _launch(x, weight, eps, unit_offset, None, None)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float = 1e-6, *,
                       unit_offset: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """residual += x in place (must be contiguous); returns (norm(residual), residual)."""
    if residual.shape != x.shape or not residual.is_contiguous():
        raise ValueError("residual must be contiguous and shaped like x")
    return _launch(x, weight, eps, unit_offset, residual, None), residual


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float = 1e-6) -> torch.Tensor:
    """rmsnorm(x) * w * silu(z) over the last dim (plain w); z is shaped like x."""
    if z.shape != x.shape:
        raise ValueError("z must be shaped like x")
    return _launch(x, weight, eps, False, None, z.reshape(-1, x.shape[-1]).contiguous())

"""SiLU-and-mul in Triton: the activation between the fused gate_up and the down projection."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def silu_and_mul_fwd_kernel(
    x,  # [num_rows, 2 * D]
    o,  # [num_rows, D]
    D,
    BLOCK_D: tl.constexpr,
):
    i_row, i_d = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    m_d = o_d < D
    p_gate = x + i_row * 2 * D + o_d
    b_gate = tl.load(p_gate, mask=m_d, other=0.0).to(tl.float32)
    b_up = tl.load(p_gate + D, mask=m_d, other=0.0).to(tl.float32)
    b_o = b_gate * tl.sigmoid(b_gate) * b_up
    tl.store(o + i_row * D + o_d, b_o.to(o.dtype.element_ty), mask=m_d)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2d] -> [..., d]: silu(x[..., :d]) * x[..., d:]."""
    if x.shape[-1] % 2:
        raise ValueError(f"last dim {x.shape[-1]} is not even")
    D = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * D).contiguous()  # [num_rows, 2 * D]
    o = x2.new_empty(x2.shape[0], D)
    BLOCK_D = min(1024, triton.next_power_of_2(D))
    silu_and_mul_fwd_kernel[(x2.shape[0], triton.cdiv(D, BLOCK_D))](x2, o, D, BLOCK_D=BLOCK_D)
    return o.view(*x.shape[:-1], D)

"""The one-row product in Triton: each program streams BLOCK_N rows of the weight past one x.

A batch-1 decode step is a weight read: on the H200 cuBLAS ran Qwen3-8B's qkv and o
projections at ~73 % of the copy bandwidth and its down projection at ~85 % plus a split-K
reduce kernel. Here a program owns BLOCK_N output features and walks the whole K dim in
BLOCK_K steps, accumulating w * x in an fp32 [BLOCK_N, BLOCK_K] tile that it sums once at the
end: no split-K, no second kernel, and every weight byte is read once, in 16-byte vectors along
its rows. Whether that beats cuBLAS for a given shape is measured on the device, not assumed
(`engine.gpu_linear`); `CONFIGS` are the tilings tried.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps): a weight tile of 16 or 32 KB in flight per program.
CONFIGS = ((16, 512, 4), (32, 256, 4), (8, 1024, 4), (16, 1024, 8))


@triton.jit
def gemv_fwd_kernel(
    x,  # [K]
    w,  # [N, K], rows contiguous
    o,  # [N]
    N, K, stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
):
    i_n = tl.program_id(0)
    o_r = tl.arange(0, BLOCK_N)
    o_k = tl.arange(0, BLOCK_K)
    m_r = i_n * BLOCK_N + o_r < N
    # Rows from a scalar base and int32 offsets: no 64-bit address held per element.
    p_w = w + (i_n * BLOCK_N).to(tl.int64) * stride_wn
    b_acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            b_x = tl.load(x + k0 + o_k).to(tl.float32)
            b_w = tl.load(p_w + o_r[:, None] * stride_wn + (k0 + o_k)[None, :], mask=m_r[:, None],
                          other=0.0)
        else:
            m_k = k0 + o_k < K
            b_x = tl.load(x + k0 + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_w = tl.load(p_w + o_r[:, None] * stride_wn + (k0 + o_k)[None, :],
                          mask=m_r[:, None] & m_k[None, :], other=0.0)
        b_acc += b_w.to(tl.float32) * b_x[None, :]
    b_o = tl.sum(b_acc, axis=1)
    tl.store(o + i_n * BLOCK_N + o_r, b_o.to(o.dtype.element_ty), mask=m_r)


def gemv(x: torch.Tensor, weight: torch.Tensor,
         config: tuple[int, int, int] = CONFIGS[0]) -> torch.Tensor:
    """x [1, K] (contiguous) @ weight [N, K]^T -> [1, N] in x's dtype, fp32 sums; `config` one
    of CONFIGS (BLOCK_N, BLOCK_K, num_warps)."""
    N, K = weight.shape
    if x.dim() != 2 or x.shape != (1, K) or not x.is_contiguous():
        raise ValueError(f"x must be a contiguous [1, {K}], got {tuple(x.shape)}")
    if weight.stride(1) != 1:
        raise ValueError("the weight's rows must be contiguous")
    o = torch.empty(1, N, dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps = config
    gemv_fwd_kernel[(triton.cdiv(N, block_n),)](
        x, weight, o, N, K, weight.stride(0), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=K % block_k == 0, num_warps=num_warps,
    )
    return o

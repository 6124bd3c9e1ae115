"""One row times a weight matrix (x [1, K] @ w[N, K]^T): a batch-1 decode step's projections."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.gemv.naive import naive_gemv

__all__ = ["gemv", "naive_gemv"]

__getattr__ = triton_on_first_use(__name__, {"gemv"})

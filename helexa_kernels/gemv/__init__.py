"""One row times a weight matrix (x [1, K] @ w[N, K]^T): a batch-1 decode step's projections."""

from helexa_kernels.gemv.naive import naive_gemv

__all__ = ["gemv", "naive_gemv"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"gemv"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.gemv import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

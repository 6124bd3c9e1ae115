"""Gated DeltaNet gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""

from helexa_kernels.gdn_gating.naive import naive_gdn_gating

__all__ = ["gdn_gating", "naive_gdn_gating"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"gdn_gating"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.gdn_gating import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Depthwise causal conv1d (+ SiLU) with per-sequence state slots: varlen prefill and decode update."""

from helexa_kernels.causal_conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update", "naive_causal_conv1d",
           "naive_causal_conv1d_update"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"causal_conv1d", "causal_conv1d_update"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.causal_conv1d import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

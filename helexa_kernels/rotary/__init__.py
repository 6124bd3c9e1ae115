"""Rotate-half RoPE with partial rotary, from a cos/sin cache indexed by position."""

from helexa_kernels.rotary.naive import build_cos_sin_cache, naive_rotary

__all__ = ["build_cos_sin_cache", "naive_rotary", "rotary"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"rotary"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.rotary import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

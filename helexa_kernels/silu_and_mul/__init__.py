"""SiLU-and-mul: out = silu(x[..., :d]) * x[..., d:]."""

from helexa_kernels.silu_and_mul.naive import naive_silu_and_mul

__all__ = ["naive_silu_and_mul", "silu_and_mul"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"silu_and_mul"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.silu_and_mul import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

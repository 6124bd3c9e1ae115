"""SiLU-and-mul: out = silu(x[..., :d]) * x[..., d:]."""

from kernels.silu_and_mul.naive import naive_silu_and_mul
from kernels.silu_and_mul.triton import silu_and_mul

__all__ = ["naive_silu_and_mul", "silu_and_mul"]

"""SiLU-and-mul: out = silu(x[..., :d]) * x[..., d:]."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.silu_and_mul.naive import naive_silu_and_mul

__all__ = ["naive_silu_and_mul", "silu_and_mul"]

__getattr__ = triton_on_first_use(__name__, {"silu_and_mul"})

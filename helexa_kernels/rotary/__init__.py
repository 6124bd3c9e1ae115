"""Rotate-half RoPE with partial rotary, from a cos/sin cache indexed by position."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.rotary.naive import build_cos_sin_cache, naive_rotary

__all__ = ["build_cos_sin_cache", "naive_rotary", "rotary"]

__getattr__ = triton_on_first_use(__name__, {"rotary"})

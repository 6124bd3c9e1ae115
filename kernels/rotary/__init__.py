"""Rotate-half RoPE with partial rotary, from a cos/sin cache indexed by position."""

from kernels.rotary.naive import build_cos_sin_cache, naive_rotary
from kernels.rotary.triton import rotary

__all__ = ["build_cos_sin_cache", "naive_rotary", "rotary"]

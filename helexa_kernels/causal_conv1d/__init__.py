"""Depthwise causal conv1d (+ SiLU) with per-sequence state slots: varlen prefill and decode update."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.causal_conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update", "naive_causal_conv1d",
           "naive_causal_conv1d_update"]

__getattr__ = triton_on_first_use(__name__, {"causal_conv1d", "causal_conv1d_update"})

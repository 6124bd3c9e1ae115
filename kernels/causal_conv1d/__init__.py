"""Depthwise causal conv1d (+ SiLU) with per-sequence state slots: varlen prefill and decode update."""

from kernels.causal_conv1d.naive import naive_causal_conv1d, naive_causal_conv1d_update
from kernels.causal_conv1d.triton import causal_conv1d, causal_conv1d_update

__all__ = ["causal_conv1d", "causal_conv1d_update", "naive_causal_conv1d",
           "naive_causal_conv1d_update"]

"""Gated DeltaNet gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""

from kernels.gdn_gating.naive import naive_gdn_gating
from kernels.gdn_gating.triton import gdn_gating

__all__ = ["gdn_gating", "naive_gdn_gating"]

"""Gated DeltaNet gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b)."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.gdn_gating.naive import naive_gdn_gating

__all__ = ["gdn_gating", "naive_gdn_gating"]

__getattr__ = triton_on_first_use(__name__, {"gdn_gating"})

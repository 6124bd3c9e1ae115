"""RMSNorm (+ fused residual add, (1 + w) weights, silu(z) gate)."""

from kernels.rmsnorm.naive import naive_fused_add_rms_norm, naive_gated_rms_norm, naive_rms_norm
from kernels.rmsnorm.triton import fused_add_rms_norm, gated_rms_norm, rms_norm

__all__ = ["fused_add_rms_norm", "gated_rms_norm", "naive_fused_add_rms_norm",
           "naive_gated_rms_norm", "naive_rms_norm", "rms_norm"]

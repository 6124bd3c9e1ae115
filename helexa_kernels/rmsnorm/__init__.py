"""RMSNorm (+ fused residual add, (1 + w) weights, silu(z) gate)."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.rmsnorm.naive import naive_fused_add_rms_norm, naive_gated_rms_norm, naive_rms_norm

__all__ = ["fused_add_rms_norm", "gated_rms_norm", "naive_fused_add_rms_norm",
           "naive_gated_rms_norm", "naive_rms_norm", "rms_norm"]

__getattr__ = triton_on_first_use(__name__, {"fused_add_rms_norm", "gated_rms_norm", "rms_norm"})

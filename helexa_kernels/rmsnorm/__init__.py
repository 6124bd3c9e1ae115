"""RMSNorm (+ fused residual add, (1 + w) weights, silu(z) gate)."""

from helexa_kernels.rmsnorm.naive import naive_fused_add_rms_norm, naive_gated_rms_norm, naive_rms_norm

__all__ = ["fused_add_rms_norm", "gated_rms_norm", "naive_fused_add_rms_norm",
           "naive_gated_rms_norm", "naive_rms_norm", "rms_norm"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"fused_add_rms_norm", "gated_rms_norm", "rms_norm"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.rmsnorm import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

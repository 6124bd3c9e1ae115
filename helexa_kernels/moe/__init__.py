"""Mixture of experts: softmax top-k routing, grouped matmul over expert-sorted rows, fused MoE MLP."""

from helexa_kernels.moe.naive import naive_fused_moe, naive_grouped_matmul, naive_moe_routing

__all__ = ["fused_moe", "grouped_matmul", "moe_routing", "naive_fused_moe",
           "naive_grouped_matmul", "naive_moe_routing"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"fused_moe", "grouped_matmul", "moe_routing"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.moe import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

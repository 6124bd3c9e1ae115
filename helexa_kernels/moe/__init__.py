"""Mixture of experts: softmax top-k routing, grouped matmul over expert-sorted rows, fused MoE MLP."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.moe.naive import naive_fused_moe, naive_grouped_matmul, naive_moe_routing

__all__ = ["fused_moe", "grouped_matmul", "moe_routing", "naive_fused_moe",
           "naive_grouped_matmul", "naive_moe_routing"]

__getattr__ = triton_on_first_use(__name__, {"fused_moe", "grouped_matmul", "moe_routing"})

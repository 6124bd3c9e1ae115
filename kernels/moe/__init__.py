"""Mixture of experts: softmax top-k routing, grouped matmul over expert-sorted rows, fused MoE MLP."""

from kernels.moe.naive import naive_fused_moe, naive_grouped_matmul, naive_moe_routing
from kernels.moe.triton import fused_moe, grouped_matmul, moe_routing

__all__ = ["fused_moe", "grouped_matmul", "moe_routing", "naive_fused_moe",
           "naive_grouped_matmul", "naive_moe_routing"]

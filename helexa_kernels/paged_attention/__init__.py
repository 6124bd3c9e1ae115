"""Paged attention over a block-table KV cache: decode, varlen prefill, chunked continuation, GQA."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.paged_attention.naive import naive_paged_attention

__all__ = ["naive_paged_attention", "paged_attention"]

__getattr__ = triton_on_first_use(__name__, {"paged_attention"})

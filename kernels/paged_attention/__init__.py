"""Paged attention over a block-table KV cache: decode, varlen prefill, chunked continuation, GQA."""

from kernels.paged_attention.naive import naive_paged_attention
from kernels.paged_attention.triton import paged_attention

__all__ = ["naive_paged_attention", "paged_attention"]

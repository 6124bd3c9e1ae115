"""Paged attention over a block-table KV cache: decode, varlen prefill, chunked continuation, GQA."""

from helexa_kernels.paged_attention.naive import naive_paged_attention

__all__ = ["naive_paged_attention", "paged_attention"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"paged_attention"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.paged_attention import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

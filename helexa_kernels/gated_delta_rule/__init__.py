"""Gated delta rule (gated DeltaNet): recurrent decode and chunked prefill on fp32 state slots."""

from helexa_kernels.gated_delta_rule.naive import l2norm, naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "l2norm", "naive_chunk_gated_delta_rule",
           "naive_recurrent_gated_delta_rule", "recurrent_gated_delta_rule"]


# The Triton ops import Triton (and decide interpreter or GPU then): load them on first use.
_TRITON_OPS = {"chunk_gated_delta_rule", "recurrent_gated_delta_rule"}


def __getattr__(name: str) -> object:
    if name in _TRITON_OPS:
        from helexa_kernels.gated_delta_rule import triton as triton_ops

        return getattr(triton_ops, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

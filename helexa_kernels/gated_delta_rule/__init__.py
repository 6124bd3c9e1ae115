"""Gated delta rule (gated DeltaNet): recurrent decode and chunked prefill on fp32 state slots."""

from helexa_kernels import triton_on_first_use
from helexa_kernels.gated_delta_rule.naive import l2norm, naive_chunk_gated_delta_rule, naive_recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "l2norm", "naive_chunk_gated_delta_rule",
           "naive_recurrent_gated_delta_rule", "recurrent_gated_delta_rule"]

__getattr__ = triton_on_first_use(__name__, {"chunk_gated_delta_rule", "recurrent_gated_delta_rule"})

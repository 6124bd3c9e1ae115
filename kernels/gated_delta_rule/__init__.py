"""Gated delta rule (gated DeltaNet): recurrent decode and chunked prefill on fp32 state slots."""

from kernels.gated_delta_rule.naive import (l2norm, naive_chunk_gated_delta_rule,
                                            naive_recurrent_gated_delta_rule)
from kernels.gated_delta_rule.triton import chunk_gated_delta_rule, recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "l2norm", "naive_chunk_gated_delta_rule",
           "naive_recurrent_gated_delta_rule", "recurrent_gated_delta_rule"]

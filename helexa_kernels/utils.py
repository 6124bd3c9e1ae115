"""What the Triton launchers share: the operand dtype and precision of `tl.dot`.

fp32 inputs get exact ("ieee") products, so tests can compare against the references at 1e-5;
half-precision inputs multiply in their own dtype on tensor cores, with fp32 accumulation.
Triton's CPU interpreter mishandles bf16 `tl.dot` operands, so there they are widened to fp32.
"""

from __future__ import annotations

import os

import torch
import triton.language as tl

_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_args(dtype: torch.dtype) -> dict[str, object]:
    """constexpr kwargs DOT_DTYPE (what `tl.dot` operands are cast to) and PRECISION."""
    dot_dtype = tl.float32 if interpreting() else _TL_DTYPES[dtype]
    return {"DOT_DTYPE": dot_dtype, "PRECISION": "ieee" if dtype == torch.float32 else "tf32"}

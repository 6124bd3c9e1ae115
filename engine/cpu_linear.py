"""How a linear layer runs on CPU: from a copy of its weight prepacked once for oneDNN.

`F.linear` on CPU reorders the weight into the matmul kernel's blocked layout on every call
(bf16 through oneDNN) or runs a plain sgemm (fp32). For a decode step, which streams every weight
once for a handful of rows, that reorder is most of the work: on a 2-core AVX-512 machine the
default model's projections at 16 rows run 1.65× faster from prepacked weights in bf16 and 2.2×
in fp32, 1.5-1.6× at one row, about the same at 512 (`bench/cpu_linear.py`,
bench/results/cpu_linear-cpu-epyc.json). So the model runner
packs every linear layer's weight once, at build (`prepack_model`), and `engine.models.layers.Linear`
runs from the packed copy. The checkpoint's own weight stays as it is (the loader, tied
embeddings and the parity tests read it); the packed copy costs one more copy of the linear
weights in memory.

Only CPU tensors in fp32 or bf16 are packed, and only where this torch has oneDNN; everything
else runs `F.linear`. `dtype_choice` times the same op the engine will run (`linear_op`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("helexa.engine")

PACKABLE = (torch.float32, torch.bfloat16)
# How linears run, part of what a remembered dtype measurement was taken with (engine.dtype_cache).
METHOD = "onednn-prepacked" if torch.backends.mkldnn.is_available() else "F.linear"
# The row count oneDNN is told to expect; measured: any of 1, 16 or 512 serves 1 to 2048 rows alike.
BATCH_HINT = 16


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE
            and torch.backends.mkldnn.is_available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> an opaque oneDNN tensor of the same weight, laid out for its matmul."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), BATCH_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ W.T + b from `pack(W)`; x [..., in] -> [..., out]."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear_op(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T as the engine runs it for this weight (packed where it can be)."""
    if can_pack(weight):
        packed = pack(weight)
        return lambda x: packed_linear(x, packed, None)
    return lambda x: F.linear(x, weight)


class Linear(nn.Linear):
    """`nn.Linear` that runs from a prepacked copy of its weight once `prepack` has made one.
    The copy is taken when `prepack` runs: call it once the weights are final (and again if
    they are ever changed in place)."""

    packed: torch.Tensor | None = None

    def prepack(self) -> bool:
        if not can_pack(self.weight):
            return False
        self.packed = pack(self.weight)
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


def prepack_model(model: nn.Module) -> int:
    """Pack every `Linear` of the model that can be (call once its weights are loaded);
    returns how many were."""
    packed = sum(module.prepack() for module in model.modules() if isinstance(module, Linear))
    if packed:
        log.info("%d linear layers prepacked for oneDNN", packed)
    return packed

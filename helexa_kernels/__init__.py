"""Kernels for the hot paths, one folder per op: `helexa_kernels/<op>/{naive,aten,triton}.py`.

`naive.py` is the plain PyTorch reference (what the Triton version is tested against);
`aten.py`, where it pays, the same math in few ATen calls (what the engine's PyTorch path runs);
`triton.py` holds the `<op>_fwd_kernel` and its launcher, loaded on first use. Each op's
`__init__` exports the reference and the Triton op. Tensors are token-major and flat
(`[num_tokens, ...]` plus `cu_seqlens` for varlen batches), as the engine lays out a step.

Tests (tests/kernels) run each Triton op against its reference in Triton's CPU interpreter on
tiny shapes, compile every kernel for sm_90 with Triton's bundled ptxas, and run full shapes
on a GPU when there is one; benchmarks/gpu_kernels.py times them against the references.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable


def triton_on_first_use(package: str, names: set[str]) -> Callable[[str], object]:
    """A package `__getattr__` that loads `<package>.triton` the first time one of its `names` is
    asked for: importing Triton decides interpreter or GPU, so a CPU engine that never calls a
    Triton op never loads it."""

    def load(name: str) -> object:
        if name in names:
            return getattr(importlib.import_module(f"{package}.triton"), name)
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return load

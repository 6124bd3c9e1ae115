"""Kernel tests: Triton kernels against their naive.py references.

Without CUDA the kernels run in Triton's interpreter on CPU tensors, so TRITON_INTERPRET must
be set before triton is first imported. It is set only where there is no CUDA, where nothing
outside these tests launches a Triton kernel, so other folders behave the same with or without
it. With CUDA the same tests run compiled on the GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# These stay below the TRITON_INTERPRET setting: `engine.runner.ops` imports triton. (Ruff's E402
# allows imports after an os.environ setting, so they need no noqa; isort does not move them above it.)
import pytest

from engine.runner import ops


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _kernel_choice_unset() -> Iterator[None]:
    """Every test starts (and leaves) ops choosing per tensor device, whatever an engine core set."""
    ops.use_backend("auto")
    yield
    ops.use_backend("auto")

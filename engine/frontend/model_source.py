"""A model source on disk read without its weights: the tokenizer and the id it is served under.

The worker's asyncio process needs only these (it templates, tokenizes and detokenizes); the
weights load in the engine core's process (`engine.loading.loader`). No torch here.
"""

from __future__ import annotations

from pathlib import Path

from engine.frontend.tokenizer import Tokenizer
from engine.loading.gguf_file import GGUFFile, model_id_from_path, read_tokenizer


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def model_id(path: str | Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'; a directory's own name."""
    path = Path(path)
    return model_id_from_path(path) if is_gguf(path) else path.resolve().name


def load_tokenizer(path: str | Path) -> tuple[Tokenizer, str]:
    """The tokenizer (with chat template and special ids) and the model id of a source."""
    path = Path(path)
    if is_gguf(path):
        return read_tokenizer(GGUFFile(path)), model_id(path)
    if path.is_dir():
        return Tokenizer.from_hf_dir(path), model_id(path)
    raise FileNotFoundError(f"{path} is neither a .gguf file nor a model directory")

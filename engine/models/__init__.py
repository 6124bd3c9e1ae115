"""Model families, one module each, looked up by a config's `model_type`.

Entries name a module and class rather than importing them, so adding a family costs nothing
until a checkpoint of that family is loaded.
"""

from __future__ import annotations

import importlib

from torch import nn

from engine.config import ModelConfig

# model_type -> (module, class)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "llama": ("engine.models.llama", "LlamaForCausalLM"),
}


def get_model_class(model_type: str) -> type[nn.Module]:
    try:
        module_name, class_name = MODEL_REGISTRY[model_type]
    except KeyError:
        supported = ", ".join(sorted(MODEL_REGISTRY))
        raise NotImplementedError(
            f"model_type {model_type!r} is not supported (supported: {supported})"
        ) from None
    return getattr(importlib.import_module(module_name), class_name)


def build_model(config: ModelConfig) -> nn.Module:
    return get_model_class(config.model_type)(config)

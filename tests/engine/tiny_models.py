"""Tiny configs of every model family, and our models built on them (no checkpoint): for tests
that exercise a family's layers without loading weights from disk."""

from __future__ import annotations

import torch
import transformers
from torch import nn

from engine.loading.loader import empty_model
from engine.loading.model_config import ModelConfig
from tests.engine.hybrid_models import hybrid_config


def tiny_hf_config(model_type: str) -> transformers.PretrainedConfig:
    """The family's transformers config, at test size."""
    sizes = {"vocab_size": 320, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "max_position_embeddings": 128}
    if model_type == "llama":
        return transformers.LlamaConfig(**sizes, attention_bias=True)
    if model_type == "qwen3":
        return transformers.Qwen3Config(**sizes)
    return hybrid_config(transformers, model_type, 128)


def tiny_model(model_type: str) -> nn.Module:
    """Our model of the family, on its tiny config, its weights not yet loaded."""
    raw = tiny_hf_config(model_type).to_dict()
    raw["model_type"] = model_type
    return empty_model(ModelConfig.from_hf_config(raw), torch.float32, "cpu")


def randomized_model(model_type: str) -> nn.Module:
    """`tiny_model` with small random weights (seeded), in eval mode."""
    model = tiny_model(model_type)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return model.eval()

"""Model families, one module each, looked up by a config's `model_type`.

Entries name a module and class rather than importing them, so adding a family costs nothing
until a checkpoint of that family is loaded. Shared blocks (norms, rotary, MLP) live in `layers`.

Every model class takes a `ModelConfig` and provides:
- `forward(input_ids [num_tokens], positions [num_tokens], kv_caches, meta) -> [num_tokens, hidden]`
  over a flat batch of any mix of prefills, prefill chunks and decodes (see `engine.runner.attention`);
- `compute_logits(hidden [n, hidden]) -> [n, vocab]`;
- `num_layers`, `num_kv_heads`, `head_dim`: the paged KV cache it expects, `num_layers`
  (k_cache, v_cache) pairs from `engine.runner.model_runner.allocate_kv_caches`;
- `tie_weights()`, called again by the loader after it allocates the weights.

Hybrid families (linear-attention layers beside full attention) also set `linear_state_shape`
(`engine.runner.state_cache.LinearStateShape`) and take an `engine.runner.state_cache.HybridCaches` in place of
the list of KV caches; `num_layers` then counts the full-attention layers only. A family whose
checkpoints name tensors differently from its parameters provides `checkpoint_targets` (see
`engine.loading.loader.load_weights`).
"""

from __future__ import annotations

import importlib

from torch import nn

from engine.loading.model_config import ModelConfig

# model_type -> (module, class)
MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "llama": ("engine.models.llama", "LlamaForCausalLM"),
    "qwen3": ("engine.models.qwen3", "Qwen3ForCausalLM"),
    "qwen3_moe": ("engine.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "qwen3_next": ("engine.models.qwen3_next", "Qwen3NextForCausalLM"),
    "qwen3_5": ("engine.models.qwen3_next", "Qwen3_5ForCausalLM"),
    "qwen3_5_text": ("engine.models.qwen3_next", "Qwen3_5ForCausalLM"),
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

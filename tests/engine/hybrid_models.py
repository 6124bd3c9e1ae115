"""Tiny random-weight qwen3_moe / qwen3_next / qwen3_5 checkpoints, saved by transformers as HF dirs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from engine.loading.loader import Checkpoint, load_checkpoint
from tests.engine.helpers import perturb_norms_and_biases, save_tokenizer

VOCAB_SIZE = 320
# Long enough (> 64 tokens) that the delta rule's prefill crosses a chunk boundary.
LONG_PROMPT = ("The lazy fox returns a + b, 42 times; pack my box with five dozen jugs. "
               "def add(a, b): return a + b. The quick brown dog jumps over 0123456789. ") * 3

_ATTENTION = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=VOCAB_SIZE)
_LINEAR = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
               linear_value_head_dim=8, linear_conv_kernel_dim=4)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _reference_class(transformers, model_type: str):
    return {
        "qwen3_moe": transformers.Qwen3MoeForCausalLM,
        "qwen3_next": transformers.Qwen3NextForCausalLM,
        "qwen3_5": transformers.Qwen3_5ForConditionalGeneration,
    }[model_type]


def hybrid_config(transformers, model_type: str, max_position_embeddings: int):
    attention = _ATTENTION | {"max_position_embeddings": max_position_embeddings}
    if model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**attention, **_MOE, intermediate_size=96,
                                           num_hidden_layers=3, mlp_only_layers=[1],
                                           norm_topk_prob=True, bos_token_id=1, eos_token_id=2)
    if model_type == "qwen3_next":
        return transformers.Qwen3NextConfig(
            **attention, **_LINEAR, **_MOE, intermediate_size=96, shared_expert_intermediate_size=48,
            num_hidden_layers=4, layer_types=["linear_attention", "full_attention",
                                              "linear_attention", "full_attention"],
            mlp_only_layers=[2], bos_token_id=1, eos_token_id=2)
    text = dict(**attention, **_LINEAR, intermediate_size=96, num_hidden_layers=3,
                layer_types=["linear_attention", "full_attention", "linear_attention"],
                bos_token_id=1, eos_token_id=2)
    vision = dict(depth=1, hidden_size=32, intermediate_size=32, num_heads=2, out_hidden_size=64)
    return transformers.Qwen3_5Config(text_config=text, vision_config=vision)


def reference_model(transformers, model_type: str, directory: Path):
    return _reference_class(transformers, model_type).from_pretrained(directory, dtype=torch.float32).eval()


def save_hybrid_dir(transformers, model_type: str, directory: Path,
                    max_position_embeddings: int = 512) -> Path:
    """Build, perturb (norms, biases, routers, gates) and save; plus a tokenizer with a chat template."""
    directory.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    config = hybrid_config(transformers, model_type, max_position_embeddings)
    model = _reference_class(transformers, model_type)(config).float()
    perturb_norms_and_biases(model)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                param.mul_(20.0)  # spread the router so top-k never hangs on a near tie
            if name.endswith(("dt_bias", "A_log")):
                param.add_(torch.randn_like(param) * 0.3)
    model.save_pretrained(directory)
    save_tokenizer(directory, VOCAB_SIZE)
    return directory


def hybrid_fixtures(model_types: list[str], folder: str) -> tuple[Callable[..., Path], Callable[..., Checkpoint]]:
    """A module's `model_dir` (one tiny checkpoint per model type, saved by transformers) and its
    loaded `checkpoint`, both once per module: `model_dir, checkpoint = hybrid_fixtures([...], "x")`."""

    @pytest.fixture(params=model_types, scope="module")
    def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
        import transformers

        return save_hybrid_dir(transformers, request.param, tmp_path_factory.mktemp(folder) / f"tiny-{request.param}")

    @pytest.fixture(scope="module")
    def checkpoint(model_dir: Path) -> Checkpoint:
        return load_checkpoint(model_dir)

    return model_dir, checkpoint

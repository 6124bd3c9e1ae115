"""A bf16 model keeps its residual stream in fp32 (engine.models.layers.residual_stream), in
every model family, and on SmolLM2 that keeps its logits near the fp32 model's."""

from __future__ import annotations

import pytest
import torch

from engine.loading.default_model import default_model_path
from engine.loading.loader import Checkpoint, load_checkpoint
from engine.runner import ops
from engine.runner.model_runner import allocate_kv_caches
from engine.runner.step_metadata import AttentionMetadata
from tests.engine.helpers import PagedSequences
from tests.engine.tiny_models import randomized_model

# Mean |bf16 logit - fp32 logit| over every position of the chat prompts below. Measured on an
# AMD EPYC (avx512_bf16): 0.095 with the fp32 stream, 0.15 with a bf16 one.
MAX_MEAN_LOGIT_ERROR = 0.12


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5"])
def test_every_family_adds_into_an_fp32_stream_in_bf16(model_type: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = randomized_model(model_type).to(torch.bfloat16)
    seen: list[tuple[torch.dtype, torch.dtype]] = []
    fused = ops.fused_add_rms_norm

    def recording(x, residual, *args, **kwargs):
        normed, residual = fused(x, residual, *args, **kwargs)
        seen.append((residual.dtype, normed.dtype))
        return normed, residual

    monkeypatch.setattr(ops, "fused_add_rms_norm", recording)
    with torch.inference_mode():
        logits = PagedSequences(model, [16, 16]).step({0: list(range(3, 12)), 1: list(range(40, 45))})
    # Two adds per layer (attention, MLP); the first layer's input norm starts the stream.
    assert len(seen) == 2 * model.config.num_hidden_layers
    assert set(seen) == {(torch.float32, torch.bfloat16)}
    assert all(torch.isfinite(row.float()).all() for row in logits)


def _logits(checkpoint: Checkpoint, ids: list[int]) -> torch.Tensor:
    model = checkpoint.model
    num_blocks = -(-len(ids) // 16)
    caches = allocate_kv_caches(model.config, num_blocks, 16, next(model.parameters()).dtype, "cpu")
    meta = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(num_blocks))], 16, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids)), caches, meta)
        return model.compute_logits(hidden).float()


def test_bf16_smollm2_logits_stay_near_the_fp32_models(smollm2: Checkpoint) -> None:
    bf16 = load_checkpoint(default_model_path(), dtype=torch.bfloat16)
    errors = []
    for question in ["What is the capital of France?", "Explain how a compass works.",
                     "List three uses of copper.", "Write a haiku about rain."]:
        text = smollm2.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                     add_generation_prompt=True)
        ids = smollm2.tokenizer.encode(text, add_special_tokens=False)
        errors.append((_logits(bf16, ids) - _logits(smollm2, ids)).abs().mean().item())
    assert max(errors) < MAX_MEAN_LOGIT_ERROR, errors

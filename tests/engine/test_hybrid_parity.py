"""qwen3_moe, qwen3_next and qwen3_5: tiny random-weight checkpoints saved by transformers, run by us.

The prompt is longer than one delta-rule chunk (64 tokens), and chunked prefill, decode, ragged and
mixed batches must all agree with one whole-prompt prefill.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine.loading.loader import Checkpoint
from tests.engine.helpers import (
    assert_mixed_steps_match_each_alone,
    assert_ragged_batch_matches_each_alone,
    chunked_logits,
)
from tests.engine.hybrid_models import LONG_PROMPT, VOCAB_SIZE, hybrid_fixtures, reference_model

MODEL_TYPES = ["qwen3_moe", "qwen3_next", "qwen3_5"]


model_dir, checkpoint = hybrid_fixtures(MODEL_TYPES, "hybrid")


@pytest.fixture(scope="module")
def prompt_ids(checkpoint: Checkpoint) -> list[int]:
    ids = checkpoint.tokenizer.encode(LONG_PROMPT)
    assert len(ids) > 64
    return ids


@torch.inference_mode()
def test_logits_match_transformers(model_dir: Path, checkpoint: Checkpoint,
                                   prompt_ids: list[int]) -> None:
    theirs = reference_model(transformers, checkpoint.config.model_type, model_dir)(
        torch.tensor([prompt_ids])).logits[0]
    ours = chunked_logits(checkpoint.model, prompt_ids)
    assert ours.shape == theirs.shape == (len(prompt_ids), VOCAB_SIZE)
    assert (ours - theirs).abs().max().item() < 1e-3
    assert F.cosine_similarity(ours, theirs, dim=-1).min().item() > 0.9999


def test_kv_cache_covers_attention_layers_only(checkpoint: Checkpoint) -> None:
    config, model = checkpoint.config, checkpoint.model
    expected = {"qwen3_moe": 3, "qwen3_next": 2, "qwen3_5": 1}[config.model_type]
    assert model.num_layers == config.num_attention_layers == expected
    shape = getattr(model, "linear_state_shape", None)
    if config.model_type != "qwen3_moe":
        assert shape is not None and shape.num_layers == config.num_hidden_layers - expected


@torch.inference_mode()
def test_chunked_prefill_and_decode_match_one_prefill(checkpoint: Checkpoint,
                                                      prompt_ids: list[int]) -> None:
    model, n = checkpoint.model, len(prompt_ids)
    full = chunked_logits(model, prompt_ids)
    chunks = chunked_logits(model, prompt_ids, [5, 61, n - 66])
    decoded = chunked_logits(model, prompt_ids, [n - 8] + [1] * 8)
    torch.testing.assert_close(chunks, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded, full, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_ragged_batch_matches_each_alone(checkpoint: Checkpoint, prompt_ids: list[int]) -> None:
    assert_ragged_batch_matches_each_alone(checkpoint.model, prompt_ids)


@torch.inference_mode()
def test_mixed_steps_match_each_alone(checkpoint: Checkpoint, prompt_ids: list[int]) -> None:
    assert_mixed_steps_match_each_alone(checkpoint.model, prompt_ids)


def test_checkpoint_pieces_must_fill_each_parameter_once(model_dir: Path,
                                                         checkpoint: Checkpoint) -> None:
    """Per-expert tensors fill slices of one stacked parameter, fused ones are split: a missing
    or surplus piece is an error, never a silently uninitialized (or overwritten) parameter."""
    from engine.loading.loader import iter_safetensors, load_weights

    model = checkpoint.model
    weights = list(iter_safetensors(model_dir, torch.float32))
    has_experts = checkpoint.config.model_type != "qwen3_5"
    piece = ".experts.3.down_proj" if has_experts else "linear_attn.in_proj_a"
    name, tensor = next((n, t) for n, t in weights if piece in n)
    with pytest.raises(ValueError, match="missing .* tensors"):
        load_weights(model, [(n, t) for n, t in weights if n != name])
    with pytest.raises(ValueError, match="more than once"):
        load_weights(model, weights + [(name, tensor)])
    if has_experts:
        with pytest.raises(ValueError, match="does not fit"):
            load_weights(model, weights + [(name.replace(".experts.3.", ".experts.9."), tensor)])
    load_weights(model, weights)  # and the real checkpoint still loads whole

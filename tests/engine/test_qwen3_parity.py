"""Qwen3 dense: a tiny random-weight checkpoint saved by transformers, loaded and run by us."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import transformers

from engine.loading.loader import Checkpoint, load_checkpoint
from tests.engine.helpers import (
    assert_mixed_steps_match_each_alone,
    assert_ragged_batch_matches_each_alone,
    chunked_logits,
    perturb_norms_and_biases,
    save_tokenizer,
)

VOCAB_SIZE = 320
PROMPT = "The lazy fox returns a + b, 42 times; pack my box."
CASES = {
    "untied": dict(tie_word_embeddings=False),
    "tied": dict(tie_word_embeddings=True),
    # Attention wider than the residual stream (4 heads x 32 > 64), as in real Qwen3 sizes.
    "wide-heads-bias": dict(tie_word_embeddings=False, head_dim=32, attention_bias=True,
                            rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.fixture(params=list(CASES), scope="module")
def qwen3_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("qwen3") / f"tiny-qwen3-{request.param}"
    directory.mkdir()
    torch.manual_seed(0)
    kwargs = dict(head_dim=16) | CASES[request.param]
    config = transformers.Qwen3Config(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, **kwargs)
    model = transformers.Qwen3ForCausalLM(config).float()
    perturb_norms_and_biases(model)
    model.save_pretrained(directory)
    save_tokenizer(directory, VOCAB_SIZE)
    return directory


@pytest.fixture(scope="module")
def checkpoint(qwen3_dir: Path) -> Checkpoint:
    return load_checkpoint(qwen3_dir)


@pytest.fixture(scope="module")
def prompt_ids(checkpoint: Checkpoint) -> list[int]:
    ids = checkpoint.tokenizer.encode(PROMPT)
    assert len(ids) >= 12
    return ids


@torch.inference_mode()
def test_logits_match_transformers(qwen3_dir: Path, checkpoint: Checkpoint,
                                   prompt_ids: list[int]) -> None:
    reference = transformers.Qwen3ForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    theirs = reference.eval()(torch.tensor([prompt_ids])).logits[0]
    ours = chunked_logits(checkpoint.model, prompt_ids)
    assert ours.shape == theirs.shape == (len(prompt_ids), VOCAB_SIZE)
    assert (ours - theirs).abs().max().item() < 1e-3
    assert F.cosine_similarity(ours, theirs, dim=-1).min().item() > 0.9999


def test_config_and_tied_weights(qwen3_dir: Path, checkpoint: Checkpoint) -> None:
    config, model = checkpoint.config, checkpoint.model
    case = CASES[qwen3_dir.name.removeprefix("tiny-qwen3-")]
    assert config.model_type == "qwen3" and config.head_dim == case.get("head_dim", 16)
    assert (model.num_layers, model.num_kv_heads, model.head_dim) == (2, 2, config.head_dim)
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    assert tied == case["tie_word_embeddings"]


@torch.inference_mode()
@pytest.mark.parametrize("block_size", [4, 16], ids=lambda b: f"block{b}")
def test_chunked_prefill_and_decode_match_one_prefill(checkpoint: Checkpoint,
                                                      prompt_ids: list[int],
                                                      block_size: int) -> None:
    model, n = checkpoint.model, len(prompt_ids)
    full = chunked_logits(model, prompt_ids, block_size=block_size)
    two_chunks = chunked_logits(model, prompt_ids, [5, n - 5], block_size=block_size)
    decoded = chunked_logits(model, prompt_ids, [3] + [1] * (n - 3), block_size=block_size)
    torch.testing.assert_close(two_chunks, full, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(decoded, full, atol=1e-4, rtol=1e-4)


@torch.inference_mode()
def test_ragged_batch_matches_each_alone(checkpoint: Checkpoint, prompt_ids: list[int]) -> None:
    assert_ragged_batch_matches_each_alone(checkpoint.model, prompt_ids)


@torch.inference_mode()
def test_mixed_steps_match_each_alone(checkpoint: Checkpoint, prompt_ids: list[int]) -> None:
    assert_mixed_steps_match_each_alone(checkpoint.model, prompt_ids)

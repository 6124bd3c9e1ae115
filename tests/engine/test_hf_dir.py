"""HF model directories: a tiny random-weight Llama saved by transformers, loaded by us."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from engine.loading.loader import load_checkpoint
from tests.engine.helpers import chunked_logits, perturb_norms_and_biases, save_tokenizer

VOCAB_SIZE = 512

CASES = {
    "untied": dict(tie_word_embeddings=False),
    "tied-llama3-rope": dict(tie_word_embeddings=True, rope_parameters={
        "rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "sharded-bias": dict(tie_word_embeddings=False, attention_bias=True),
}


@pytest.fixture(params=list(CASES), scope="module")
def hf_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("hf") / f"tiny-llama-{request.param}"
    directory.mkdir()
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        bos_token_id=1, eos_token_id=2, **CASES[request.param])
    model = transformers.LlamaForCausalLM(config).float()
    perturb_norms_and_biases(model)
    shard = "60KB" if request.param.startswith("sharded") else "50MB"
    model.save_pretrained(directory, max_shard_size=shard)
    model.generation_config.eos_token_id = [2, 0]
    model.generation_config.save_pretrained(directory)
    save_tokenizer(directory, VOCAB_SIZE)
    return directory


@torch.inference_mode()
def test_logits_match_transformers(hf_dir: Path) -> None:
    checkpoint = load_checkpoint(hf_dir)
    reference = transformers.LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = checkpoint.tokenizer.encode("The lazy fox returns a + b, 42 times.")
    ours = chunked_logits(checkpoint.model, ids)
    theirs = reference(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-4
    if checkpoint.config.tie_word_embeddings:
        assert checkpoint.model.lm_head.weight is checkpoint.model.model.embed_tokens.weight


def test_checkpoint_metadata(hf_dir: Path) -> None:
    checkpoint = load_checkpoint(hf_dir)
    assert checkpoint.model_id == hf_dir.name
    assert checkpoint.config.num_key_value_heads == 2 and checkpoint.config.head_dim == 16
    tok = checkpoint.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.stop_token_ids) == (1, 2, [0])
    assert tok.all_stop_token_ids == [2, 0]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(text, add_special_tokens=False)[0] == 1


def test_sharded_checkpoint_has_index(hf_dir: Path) -> None:
    if "sharded" in hf_dir.name:
        assert (hf_dir / "model.safetensors.index.json").is_file()


def test_unsupported_model_type(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "gpt2", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8,
        "num_hidden_layers": 1, "num_attention_heads": 2}))
    with pytest.raises(NotImplementedError, match="model_type 'gpt2' is not supported"):
        load_checkpoint(tmp_path)


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.gguf")

"""The models of the GPU engine benchmark (`benchmarks.gpu_engine`): the real Qwen3 and Qwen3.5-style
hybrid shapes and their tiny CPU forms, an HF model with random weights and our engine's model holding
the same weights, and the weight bytes one decode step reads.
"""

from __future__ import annotations

import torch

from engine.frontend.tokenizer import Tokenizer
from engine.loading.loader import Checkpoint, empty_model, load_weights
from engine.loading.model_config import ModelConfig

# Real sizes (HF config.json of each model); the weights are random.
QWEN3_06B = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=True,
                 rope_parameters={"rope_type": "default", "rope_theta": 1e6})
QWEN3_8B = dict(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 1e6})
# A Qwen3.5-style hybrid (3 gated-DeltaNet layers per gated full-attention layer), ~2B.
QWEN3_5_HYBRID = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144,
                      num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                      linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, max_position_embeddings=32768,
                      tie_word_embeddings=True)
TINY_QWEN3 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  max_position_embeddings=256, tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1e4})

# The hybrid's tiny form: the same layer pattern (3 linear-attention layers, then full attention).
TINY_QWEN3_5 = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                    linear_value_head_dim=16, linear_conv_kernel_dim=4,
                    max_position_embeddings=256, tie_word_embeddings=True)


def build_pair(family: str, sizes: dict, device: str,
               dtype: torch.dtype) -> tuple[torch.nn.Module, Checkpoint]:
    """An HF model with random weights on the device, and our model holding the same weights."""
    import transformers

    if family == "qwen3":
        hf_config = transformers.Qwen3Config(bos_token_id=1, eos_token_id=2, pad_token_id=0, **sizes)
        hf_class = transformers.Qwen3ForCausalLM
    else:
        hf_config = transformers.Qwen3_5TextConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                   **sizes)
        hf_class = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        hf = hf_class(hf_config).to(dtype).eval()
    hf.generation_config.eos_token_id = None  # ignore_eos: every request runs to its length
    raw = hf_config.to_dict()
    raw["model_type"] = family  # our registry's name for the family
    config = ModelConfig.from_hf_config(raw)
    ours = empty_model(config, dtype, device)
    load_weights(ours, hf.state_dict().items())
    # Only the stop ids matter to the engine (requests here ignore eos); a one-token vocabulary
    # keeps the tokenizer real without a download.
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models
    tokenizer = Tokenizer(HFTokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                          bos_token_id=1, eos_token_id=2)
    return hf, Checkpoint(config=config, model=ours.eval(), tokenizer=tokenizer,
                          model_id=f"random-{family}")


def weight_bytes_per_decode_step(checkpoint: Checkpoint) -> int:
    """Bytes of weights one decode step reads: every parameter once, except an untied embedding
    table (a step gathers one row of it)."""
    params = dict(checkpoint.model.named_parameters())  # a tied table appears once
    total = sum(p.numel() * p.element_size() for p in params.values())
    if not checkpoint.config.tie_word_embeddings:
        total -= sum(p.numel() * p.element_size() for name, p in params.items()
                     if name.endswith("embed_tokens.weight"))
    return total

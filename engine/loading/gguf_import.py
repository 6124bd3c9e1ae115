"""Read a llama GGUF file's weights into HF-layout tensors (metadata and tokenizer: `engine.loading.gguf_file`).

No llama.cpp: the `gguf` package dequantizes each tensor. llama.cpp's converter permutes the rows
of q/k projections so RoPE can rotate adjacent pairs (HF rotates halves); that is undone here.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch
from gguf.quants import dequantize

from engine.loading.gguf_file import GGUFFile
from engine.loading.model_config import ModelConfig

# GGUF per-layer tensor name -> HF Llama name (suffix .weight / .bias is kept).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def unpermute_rope_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation, returning HF's rotate-half row order.

    llama.cpp's converter maps each head's rows [r0..r(d/2-1) | r(d/2)..r(d-1)] to interleaved
    pairs (r0, r(d/2), r1, r(d/2+1), ...); reading them back as [d/2, 2] and transposing restores
    the halves. Same as transformers' `LlamaTensorProcessor._reverse_permute_weights`.
    """
    head_dim = weight.shape[0] // num_heads
    rest = weight.shape[1:]
    # [num_heads, head_dim/2, 2, ...] -> [num_heads, 2, head_dim/2, ...]
    w = weight.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2)
    return w.reshape(weight.shape).contiguous()


def hf_name(gguf_name: str) -> str:
    if m := _LAYER_RE.fullmatch(gguf_name):
        layer, kind, suffix = m.groups()
        if kind in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"
    else:
        base, _, suffix = gguf_name.rpartition(".")
        if base in _GLOBAL_NAMES:
            return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise NotImplementedError(f"unexpected GGUF tensor {gguf_name!r}")


def iter_weights(gguf: GGUFFile, config: ModelConfig,
                 dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, dequantized tensor) pairs, one tensor in memory at a time."""
    for tensor in gguf.reader.tensors:
        # dequantize returns numpy in row-major [rows, cols] order (GGUF lists dims reversed).
        array = dequantize(tensor.data, tensor.tensor_type)
        weight = torch.from_numpy(np.array(array, dtype=np.float32, copy=True))
        if ".attn_q." in tensor.name:
            weight = unpermute_rope_rows(weight, config.num_attention_heads)
        elif ".attn_k." in tensor.name:
            weight = unpermute_rope_rows(weight, config.num_key_value_heads)
        yield hf_name(tensor.name), weight.to(dtype)

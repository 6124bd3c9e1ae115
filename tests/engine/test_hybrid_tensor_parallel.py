"""Tensor parallelism of the hybrid family on CPU (gloo): tiny random Qwen3.5 (dense MLPs; separate
q|k|v, z, b, a tensors), Qwen3-Next (MoE layers with a shared expert beside a dense one; q|k|v|z and
b|a fused per key-head group) and Qwen3-MoE sharded over 2 ranks give one rank's logits and greedy
tokens; each rank holds 1/2 of the weights, KV and linear-attention state beyond the named
replicated parts; linear heads or expert widths that do not divide are refused in one line."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers

from engine.core.core_process import build_core
from engine.core.engine_core import EngineCore
from engine.frontend.protocol import EngineRefused
from engine.loading.loader import WholeTensor, load_checkpoint, shard_reader
from engine.loading.model_config import ModelConfig
from engine.models.parallel_layers import Shard, refuse_indivisible, split_of
from tests.engine.hybrid_models import save_hybrid_dir
from tests.engine.test_tensor_parallel import assert_matches_one_rank, engine_config, greedy_run, sharded_core

WORLD = 2
# Replicated on every rank: every norm (the gated norm is one head's width), and the MoE router and
# shared-expert gate (so every rank routes alike).
REPLICATED = ("norm.weight", "mlp.gate.weight", "shared_expert_gate.weight")


# qwen3_moe: the llama-family MoE, its experts sharded the same way (no linear attention, no state).
@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_next", "qwen3_moe"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hybrid_dir(transformers, request.param, tmp_path_factory.mktemp("tp-hybrid") / request.param)


@pytest.fixture(scope="module")
def one_rank(model_dir: Path) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]], EngineCore]:
    core = build_core(engine_config(model_dir, 1))
    tokens, logits = greedy_run(core)
    return tokens, logits, core


@pytest.fixture(scope="module")
def sharded(model_dir: Path) -> Iterator[EngineCore]:
    yield from sharded_core(model_dir, WORLD)


def test_sharded_hybrid_logits_and_tokens_match_one_rank(sharded: EngineCore, one_rank: tuple) -> None:
    assert_matches_one_rank(sharded, one_rank)


def test_each_rank_holds_its_share_of_weights_kv_and_state(sharded: EngineCore, one_rank: tuple) -> None:
    whole = one_rank[2].runner
    model = sharded.runner.model
    splits = {name: split_of(model, name) for name, _ in model.named_parameters()}
    replicated = sum(p.nbytes for name, p in model.named_parameters() if splits[name].dim is None)
    assert replicated == sum(p.nbytes for name, p in model.named_parameters() if name.endswith(REPLICATED))
    assert not any(split.rank0_only for split in splits.values())  # no biases in these layers
    share = (whole.weight_bytes - replicated) // WORLD + replicated
    followers = sharded.runner.followers
    assert followers is not None
    [report] = followers.reports
    assert (whole.state_bytes > 0) == whole.is_hybrid
    assert {sharded.runner.weight_bytes, report.weight_bytes} == {share}
    assert {sharded.runner.kv_bytes, report.kv_bytes} == {whole.kv_bytes // WORLD}
    assert {sharded.runner.state_bytes, report.state_bytes} == {whole.state_bytes // WORLD}
    if whole.hybrid_caches is not None:
        shape, whole_shape = sharded.runner.hybrid_caches.states.shape, whole.hybrid_caches.states.shape  # type: ignore[union-attr]
        assert (shape.conv_dim, shape.num_v_heads) == (whole_shape.conv_dim // WORLD, whole_shape.num_v_heads // WORLD)


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_next"])
def test_a_rank_reads_whole_head_groups_of_the_conv_channels(model_type: str, tmp_path: Path) -> None:
    """Rank 1's conv channels are the second half of each of q, k and v, not of their concatenation
    (Qwen3.5's separate q|k|v tensor and Qwen3-Next's fused q|k|v|z groups alike)."""
    model_dir = save_hybrid_dir(transformers, model_type, tmp_path / model_type)
    whole = load_checkpoint(model_dir).model.model.layers[0].linear_attn
    shard = load_checkpoint(model_dir, shard=Shard(1, WORLD)).model.model.layers[0].linear_attn
    key_size, value_size = whole.num_k_heads * whole.k_dim, whole.num_v_heads * whole.v_dim
    q, k, v = whole.conv1d.weight.split((key_size, key_size, value_size))
    halves = [part[part.shape[0] // 2:] for part in (q, k, v)]
    assert torch.equal(shard.conv1d.weight, torch.cat(halves))
    assert torch.equal(shard.A_log, whole.A_log[whole.num_v_heads // 2:])
    assert torch.equal(shard.norm.weight, whole.norm.weight)


def hybrid_shapes(**overrides: object) -> ModelConfig:
    return ModelConfig.from_hf_config({
        "model_type": "qwen3_5_text", "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
        "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "full_attention_interval": 4, "hidden_act": "silu"} | overrides)


def test_linear_heads_and_expert_widths_that_do_not_divide_are_refused_in_one_line() -> None:
    refuse_indivisible(hybrid_shapes(), 2)
    with pytest.raises(EngineRefused) as refused:
        refuse_indivisible(hybrid_shapes(num_key_value_heads=4, linear_num_key_heads=6,
                                         linear_num_value_heads=18), 4)
    assert str(refused.value) == ("tensor_parallel 4 does not divide linear_num_key_heads 6, "
                                  "linear_num_value_heads 18 of this model")
    moe = {"model_type": "qwen3_next", "num_experts": 512, "num_experts_per_tok": 10}
    refuse_indivisible(hybrid_shapes(**moe, moe_intermediate_size=512, shared_expert_intermediate_size=512), 2)
    with pytest.raises(EngineRefused) as refused:
        refuse_indivisible(hybrid_shapes(**moe, num_key_value_heads=4, moe_intermediate_size=510,
                                         shared_expert_intermediate_size=510), 4)
    assert str(refused.value) == ("tensor_parallel 4 does not divide moe_intermediate_size 510, "
                                  "shared_expert_intermediate_size 510 of this model")


def test_a_rank_holds_its_columns_of_every_expert(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Per-expert checkpoint tensors and a stacked [gate | up] tensor give rank 1 the same part:
    the second half of each expert's gate rows and of its up rows, and those columns of down."""
    model_dir = save_hybrid_dir(transformers, "qwen3_next", tmp_path_factory.mktemp("tp-moe") / "qwen3_next")
    whole = load_checkpoint(model_dir).model
    shard = load_checkpoint(model_dir, shard=Shard(1, WORLD)).model
    experts, mine = whole.model.layers[0].mlp.experts, shard.model.layers[0].mlp.experts
    width = experts.down_proj.shape[-1]
    gate, up = experts.gate_up_proj.split(width, dim=1)
    assert torch.equal(mine.gate_up_proj, torch.cat([gate[:, width // 2:], up[:, width // 2:]], dim=1))
    assert torch.equal(mine.down_proj, experts.down_proj[..., width // 2:])
    read = shard_reader(shard, Shard(1, WORLD))
    assert read is not None
    stacked = read("model.layers.0.mlp.experts.gate_up_proj", WholeTensor(experts.gate_up_proj.detach()))
    assert torch.equal(stacked, mine.gate_up_proj)


"""Tensor parallelism on CPU (gloo): a tiny random llama sharded over 2 and 3 ranks gives one rank's
logits and greedy tokens; each rank holds 1/N of the weights and KV cache; shapes that do not
divide are refused in one line; a rank's death ends the core, not a hang."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
import transformers

from apps.bus import wire
from apps.gateway.metrics import GatewayMetrics
from apps.settings import WorkerSettings
from engine.core.core_process import build_core
from engine.core.engine_core import EngineCore
from engine.frontend.core_client import AsyncEngine
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineRefused, EngineRequest, FinishReason, SamplingParams
from engine.loading.loader import load_checkpoint
from engine.loading.model_config import ModelConfig
from engine.models.parallel_layers import Shard, refuse_indivisible, split_of
from tests.engine.helpers import perturb_norms_and_biases, save_tokenizer
from tests.support import eventually, eventually_async

VOCAB_SIZE = 384  # every sharded dimension divides by 2 and by 3
NUM_BLOCKS = 64
PROMPTS = [[5 + i, 40 + 3 * i, 100 + i, 7] + list(range(200, 200 + 2 * i)) for i in range(8)]
NEW_TOKENS = 32
# fp32 sums in another order: a few ulps of the logits' scale.
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tp_llama(tmp_path_factory.mktemp("tp-llama"))


def save_tp_llama(directory: Path, max_position_embeddings: int = 128) -> Path:
    """The tiny random llama (with a tokenizer and chat template) every sharded dimension of which
    divides by 2 and by 3."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=6, head_dim=8, max_position_embeddings=max_position_embeddings,
        attention_bias=True, mlp_bias=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.LlamaForCausalLM(config).float()
    perturb_norms_and_biases(model)
    model.save_pretrained(directory)
    save_tokenizer(directory, VOCAB_SIZE)
    return directory


def engine_config(model_dir: Path, tensor_parallel: int) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="float32", kernels="torch", num_kv_blocks=NUM_BLOCKS,
                        block_size=4, max_num_seqs=8, tensor_parallel=tensor_parallel)


def greedy_run(core: EngineCore) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]]]:
    """All prompts batched together: each request's tokens and its logits row at every step."""
    logits: dict[str, list[torch.Tensor]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    mask = core.runner.mask_logits

    def record(rows: torch.Tensor, request_ids: list[str]) -> None:
        for row, request_id in zip(rows, request_ids, strict=True):
            logits[request_id].append(row.clone())
        if mask is not None:
            mask(rows, request_ids)

    core.runner.mask_logits = record
    tokens: dict[str, list[int]] = {request_id: [] for request_id in logits}
    sampling = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        core.add_request(EngineRequest(f"r{i}", prompt, sampling))
    try:
        while core.has_work():
            for out in core.step():
                tokens[out.request_id].extend(out.new_token_ids)
                assert out.error is None, out.error
    finally:
        core.runner.mask_logits = mask
    return tokens, logits


@pytest.fixture(scope="module")
def one_rank(model_dir: Path) -> tuple[dict[str, list[int]], dict[str, list[torch.Tensor]], EngineCore]:
    core = build_core(engine_config(model_dir, 1))
    tokens, logits = greedy_run(core)
    return tokens, logits, core


def sharded_core(model_dir: Path, world: int) -> Iterator[EngineCore]:
    """An engine core of `world` ranks for a module fixture; no rank may be lost meanwhile."""
    lost: list[str] = []
    core = build_core(engine_config(model_dir, world), on_rank_lost=lost.append)
    yield core
    core.close()
    assert not lost, lost


def assert_matches_one_rank(sharded: EngineCore, one_rank: tuple) -> None:
    """The greedy tokens are one rank's, and the logits agree within TOLERANCE at every step."""
    tokens, logits, _ = one_rank
    sharded_tokens, sharded_logits = greedy_run(sharded)
    assert sharded_tokens == tokens
    for request_id, rows in logits.items():
        assert len(sharded_logits[request_id]) == len(rows) == NEW_TOKENS
        for step, (ours, reference) in enumerate(zip(sharded_logits[request_id], rows, strict=True)):
            error = (ours - reference).abs().max().item()
            assert error <= TOLERANCE * reference.abs().max().item(), (request_id, step, error)


@pytest.fixture(scope="module", params=[2, 3], ids=["tp2", "tp3"])
def sharded(request: pytest.FixtureRequest, model_dir: Path) -> Iterator[EngineCore]:
    yield from sharded_core(model_dir, request.param)


def test_sharded_logits_and_tokens_match_one_rank(sharded: EngineCore, one_rank: tuple) -> None:
    assert_matches_one_rank(sharded, one_rank)


def test_each_rank_holds_its_share_of_weights_and_kv(sharded: EngineCore, one_rank: tuple, model_dir: Path) -> None:
    whole = one_rank[2].runner
    world = sharded.runner.tensor_parallel
    # Replicated on every rank: the norms, and the row-parallel biases (zeros beyond rank 0).
    model = sharded.runner.model
    splits = {name: split_of(model, name) for name, _ in model.named_parameters()}
    replicated = sum(p.nbytes for name, p in model.named_parameters()
                     if splits[name][0] is None or splits[name][1])
    assert replicated == sum(p.nbytes for name, p in model.named_parameters()
                             if name.endswith(("norm.weight", "o_proj.bias", "down_proj.bias")))
    share = (whole.weight_bytes - replicated) // world + replicated
    followers = sharded.runner.followers
    assert followers is not None
    reports = followers.reports
    assert [r.rank for r in reports] == list(range(1, world))
    assert {sharded.runner.weight_bytes, *(r.weight_bytes for r in reports)} == {share}
    assert {sharded.runner.kv_bytes, *(r.kv_bytes for r in reports)} == {whole.kv_bytes // world}
    assert {r.num_blocks for r in reports} == {sharded.runner.num_blocks} == {NUM_BLOCKS}


def test_each_rank_reports_its_step_time_to_metrics(sharded: EngineCore) -> None:
    world = sharded.runner.tensor_parallel
    sharded.add_request(EngineRequest("timed", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0)))
    while sharded.has_work():
        sharded.step()
    followers = sharded.runner.followers
    assert followers is not None
    # A follower reports after its first step, up its pipe; the watch thread keeps it.
    eventually(lambda: all(t.steps > 0 for t in followers.tallies()), timeout_s=30,
               message=lambda: f"followers' reports: {followers.tallies()}")
    sharded.step()  # an idle step refreshes the stats the worker reads
    stats = sharded.stats
    assert len(stats.rank_steps) == len(stats.rank_step_seconds) == world
    assert all(steps > 0 for steps in stats.rank_steps) and all(s > 0 for s in stats.rank_step_seconds)
    # As the worker's node entry carries them (apps.worker.node_status), the gateway's /metrics.
    node = wire.NodeStatus(node="n", version="test", models=[wire.ModelStatus(
        model="tiny", rank_steps=stats.rank_steps, rank_step_seconds=stats.rank_step_seconds)])
    text = GatewayMetrics().render([node], {}).decode()
    for rank in range(world):
        assert f'helexa:engine_step_seconds_count{{model="tiny",rank="{rank}"}} {float(stats.rank_steps[rank])}' \
            in text, text


def smollm2_shapes() -> ModelConfig:
    return ModelConfig.from_hf_config({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 8192, "hidden_act": "silu"})


def test_shapes_that_do_not_divide_are_refused_in_one_line(tmp_path: Path) -> None:
    refuse_indivisible(smollm2_shapes(), 3)
    with pytest.raises(EngineRefused) as refused:
        refuse_indivisible(smollm2_shapes(), 2)
    assert str(refused.value) == ("tensor_parallel 2 does not divide num_attention_heads 9, "
                                  "num_key_value_heads 3 of this model")
    # KV heads fewer than the ranks would have to be replicated: refused, and the line says so.
    with pytest.raises(EngineRefused) as refused:
        refuse_indivisible(smollm2_shapes(), 6)
    assert str(refused.value) == ("tensor_parallel 6 does not divide num_attention_heads 9, num_key_value_heads 3 "
                                  "(fewer KV heads than ranks: replicating KV heads is not built) of this model")
    # build_core refuses before any rank is started.
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}))
    before = psutil.Process().children()
    with pytest.raises(EngineRefused, match="num_attention_heads 9"):
        build_core(EngineConfig(model=str(tmp_path), tensor_parallel=2))
    assert psutil.Process().children() == before


def test_a_rank_loads_only_its_slice(model_dir: Path) -> None:
    # The loader alone gives rank 1's shard, no group needed (the hybrid family's:
    # tests/engine/test_hybrid_tensor_parallel.py).
    shard = load_checkpoint(model_dir, shard=Shard(1, 3)).model
    whole = load_checkpoint(model_dir).model
    rows = VOCAB_SIZE // 3
    assert torch.equal(shard.lm_head.weight, whole.lm_head.weight[rows:2 * rows])
    assert not shard.model.layers[0].mlp.down_proj.bias.any()


async def test_killing_a_rank_ends_the_core_without_a_hang(model_dir: Path) -> None:
    engine = await AsyncEngine.start(engine_config(model_dir, 2))
    try:
        core = psutil.Process(engine.pid)
        [rank1] = [p for p in core.children() if p.name() != "resource_tracker"] or [None]
        assert rank1 is not None
        stream = engine.generate(EngineRequest("alive", PROMPTS[0], SamplingParams(max_tokens=4, temperature=0.0)))
        assert [out async for out in stream][-1].finish_reason is FinishReason.LENGTH
        os.kill(rank1.pid, signal.SIGKILL)
        await eventually_async(lambda: engine.exitcode is not None, 60, message="the core outlived its rank")
        assert engine.exitcode == 1
        stream = engine.generate(EngineRequest("after", PROMPTS[0], SamplingParams(max_tokens=4)))
        assert [out async for out in stream][-1].finish_reason is FinishReason.ERROR
        assert not core.is_running() or core.status() == psutil.STATUS_ZOMBIE
    finally:
        await engine.shutdown()


def test_the_setting_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().engine_config("m").tensor_parallel == 1
    monkeypatch.setenv("HELEXA_TENSOR_PARALLEL", "3")
    assert WorkerSettings().engine_config("m").tensor_parallel == 3
    monkeypatch.setenv("HELEXA_TENSOR_PARALLEL", "0")
    with pytest.raises(ValueError, match="HELEXA_TENSOR_PARALLEL must be between 1 and 64"):
        WorkerSettings()


def test_a_tied_embedding_and_lm_head_shard_together(tmp_path: Path) -> None:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
        num_attention_heads=6, num_key_value_heads=6, head_dim=8, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).float().save_pretrained(tmp_path)
    save_tokenizer(tmp_path, VOCAB_SIZE)
    whole = load_checkpoint(tmp_path).model
    rows = VOCAB_SIZE // 3
    for rank in range(3):
        shard = load_checkpoint(tmp_path, shard=Shard(rank, 3)).model
        assert shard.lm_head.weight is shard.model.embed_tokens.weight
        assert torch.equal(shard.lm_head.weight, whole.model.embed_tokens.weight[rank * rows:(rank + 1) * rows])


def test_ranks_sharing_a_gpu_use_gloo_and_ranks_with_a_gpu_each_nccl() -> None:
    from engine.runner.tensor_parallel import backend_for

    assert backend_for("cpu", 3, 0) == "gloo"
    assert backend_for("cuda", 2, 1) == "gloo"  # NCCL refuses two ranks on one device
    assert backend_for("cuda:0", 2, 2) == "nccl"
    assert backend_for("cuda", 3, 2) == "gloo"


def test_the_gpu_runs_tp_check_agrees_on_cpu(tmp_path: Path) -> None:
    """gpu_run.sh's `tp` stage is this run with --device cuda: here its CPU side, the same code."""
    out = tmp_path / "tp.json"
    # A process of its own, as gpu_run.sh runs it (this one may hold another group already).
    subprocess.run([sys.executable, "-m", "benchmarks.tensor_parallel", "--random", "--tensor-parallel", "2",
                    "--tokens", "4", "--out", str(out)], check=True, timeout=300, stdout=subprocess.DEVNULL)
    report = json.loads(out.read_text())
    assert report["greedy_identical"]
    assert [r["rank"] for r in report["tp2"]["ranks"]] == [0, 1]
    assert report["per_rank_kv_ratio"] == 0.5
    assert set(report["ratio_tok_per_s"]) == {"1", "16"}

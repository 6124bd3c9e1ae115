"""Decode CUDA graphs: bucket choice, padding that changes nothing (a hybrid model's state slots
included), never on CPU; on a GPU, replays equal to eager steps."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import WordLevel

from engine.frontend.protocol import EngineRequest
from engine.frontend.tokenizer import Tokenizer
from engine.loading.loader import Checkpoint, load_checkpoint
from engine.loading.model_config import ModelConfig
from engine.models import build_model
from engine.runner import ops
from engine.runner.cuda_graphs import (
    DecodeBuffers,
    DecodeGraphs,
    bucket_sizes,
    graphs_wanted,
    pick_bucket,
)
from engine.runner.step_metadata import SequenceChunk, StepInputs, build_step_inputs
from tests.engine.helpers import PagedSequences, perturb_norms_and_biases
from tests.engine.hybrid_models import save_hybrid_dir
from tests.engine.test_engine_core import greedy, make_core, run


def test_bucket_sizes() -> None:
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(16) == [1, 2, 4, 8, 16]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert bucket_sizes(256)[-2:] == [128, 256]
    with pytest.raises(ValueError):
        bucket_sizes(0)


def test_pick_bucket() -> None:
    buckets = bucket_sizes(48)
    assert [pick_bucket(n, buckets) for n in (1, 2, 3, 5, 16, 17, 33, 48)] == [1, 2, 4, 8, 16, 32,
                                                                              48, 48]
    assert pick_bucket(49, buckets) is None


def test_graphs_only_on_cuda_with_triton() -> None:
    ops.use_backend("auto")
    assert not graphs_wanted(True, torch.device("cpu"))
    assert graphs_wanted(True, torch.device("cuda"))
    assert not graphs_wanted(False, torch.device("cuda"))
    ops.use_backend("torch")  # the references sync with the host: no capture
    assert not graphs_wanted(True, torch.device("cuda"))
    ops.use_backend("triton")
    assert not graphs_wanted(True, torch.device("cpu"))


def test_a_cpu_engine_captures_nothing(smollm2: Checkpoint) -> None:
    core = make_core(smollm2, cuda_graphs=True)
    assert core.runner.decode_graphs is None


def _tiny_model(device: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    config = ModelConfig(model_type="qwen3", vocab_size=80, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, max_position_embeddings=64)
    model = build_model(config).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    perturb_norms_and_biases(model)
    return model.to(device=device, dtype=dtype)


def _prefilled(model: torch.nn.Module, prompts_: list[list[int]]) -> PagedSequences:
    seqs = PagedSequences(model, [len(p) + 4 for p in prompts_], block_size=4)
    seqs.step(dict(enumerate(prompts_)))
    return seqs


def _decode_inputs(seqs: PagedSequences, tokens: list[int]) -> StepInputs:
    """One decode token per sequence, laid out by the runner's step builder."""
    chunks = [SequenceChunk([token], seqs.num_computed[i], seqs.block_tables[i], sample_id=str(i))
              for i, token in enumerate(tokens)]
    return build_step_inputs(chunks, seqs.block_size, seqs.kv_caches[0][0].device)


@torch.inference_mode()
def test_padding_to_the_bucket_changes_nothing() -> None:
    """The padded static inputs run eagerly (the torch path here) give the real rows' hidden
    states exactly, and the padding rows write no KV."""
    model = _tiny_model("cpu")
    seqs = _prefilled(model, [[3, 9, 27, 5, 11], [40, 2, 2], [7, 7, 60, 1, 14, 33, 2]])
    step = _decode_inputs(seqs, [12, 50, 8])
    before = [(k.clone(), v.clone()) for k, v in seqs.kv_caches]
    padded_caches = [(k.clone(), v.clone()) for k, v in seqs.kv_caches]
    eager = model(step.input_ids, step.positions, seqs.kv_caches, step.meta)

    buffers = DecodeBuffers(max_num_seqs=8, max_blocks_per_seq=4, block_size=4,
                            device=torch.device("cpu"))
    buffers.pad(8)
    buffers.input_ids.fill_(77)  # stale rows from an earlier step must be overwritten
    buffers.block_tables.fill_(3)
    bucket = pick_bucket(3, bucket_sizes(8))
    assert bucket == 4 and buffers.fits(step)
    buffers.fill(step, bucket)
    assert buffers.input_ids[:4].tolist() == [12, 50, 8, 0]
    assert buffers.slot_mapping[:4].tolist() == [*step.meta.slot_mapping.tolist(), -1]
    assert buffers.seq_lens[:4].tolist() == [*step.meta.seq_lens.tolist(), 1]
    assert not buffers.block_tables[3].any()
    assert buffers.block_tables[0, len(seqs.block_tables[0]):].eq(0).all()
    hidden = model(buffers.input_ids[:bucket], buffers.positions[:bucket], padded_caches,
                   buffers.metadata(bucket))
    # A batch of 4 rows may round differently from one of 3 in the matmuls: close, not equal.
    torch.testing.assert_close(hidden[:3], eager, rtol=1e-5, atol=1e-5)
    untouched = torch.ones(padded_caches[0][0].shape[:2], dtype=torch.bool).view(-1)
    untouched[step.meta.slot_mapping] = False
    for (k, v), (pk, pv), (bk, bv) in zip(seqs.kv_caches, padded_caches, before, strict=True):
        torch.testing.assert_close(pk, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pv, v, rtol=1e-5, atol=1e-5)
        flat = (-1, *pk.shape[2:])
        assert torch.equal(pk.view(flat)[untouched], bk.view(flat)[untouched])
        assert torch.equal(pv.view(flat)[untouched], bv.view(flat)[untouched])


@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5"])
@torch.inference_mode()
def test_padding_leaves_hybrid_states_alone(model_type: str, tmp_path) -> None:
    """A hybrid model's padded static inputs (padding rows on state slot -1) give the real rows'
    hidden states, and every state slot ends as the eager step leaves it: the padding row moved
    none (slot -1 read as an index would be the last slot, sequence 0's)."""
    import transformers
    model = load_checkpoint(save_hybrid_dir(transformers, model_type, tmp_path / model_type)).model
    prompts_ = [[3, 9, 27, 5, 11], [40, 2, 2], [7, 7, 60, 1, 14, 33, 2]]
    eager_seqs, padded_seqs = _prefilled(model, prompts_), _prefilled(model, prompts_)
    slots = torch.tensor(eager_seqs.slots, dtype=torch.int32)  # batch order: sequences 0, 1, 2
    step = _decode_inputs(eager_seqs, [12, 50, 8])
    eager_seqs.caches.slot_indices = slots
    eager = model(step.input_ids, step.positions, eager_seqs.caches, step.meta)

    buffers = DecodeBuffers(max_num_seqs=8, max_blocks_per_seq=4, block_size=4,
                            device=torch.device("cpu"))
    buffers.pad(8)
    buffers.slot_indices.fill_(1)  # stale slots from an earlier step must be overwritten
    graphs = DecodeGraphs(model, padded_seqs.caches, buffers, bucket_sizes(8))
    bucket = pick_bucket(3, graphs.buckets)
    assert bucket == 4
    buffers.fill(_decode_inputs(padded_seqs, [12, 50, 8]), bucket, slots)
    assert buffers.slot_indices[:4].tolist() == [*slots.tolist(), -1]
    hidden = model(buffers.input_ids[:bucket], buffers.positions[:bucket],
                   graphs.bucket_caches(bucket), buffers.metadata(bucket))
    torch.testing.assert_close(hidden[:3], eager, rtol=1e-5, atol=1e-5)
    eager_states, padded_states = eager_seqs.caches.states, padded_seqs.caches.states
    for ours, theirs in zip(padded_states.conv + padded_states.recurrent,
                            eager_states.conv + eager_states.recurrent, strict=True):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_prefills_and_oversized_batches_do_not_fit() -> None:
    model = _tiny_model("cpu")
    seqs = _prefilled(model, [[3, 9], [40, 2, 2], [7, 7, 60]])
    buffers = DecodeBuffers(max_num_seqs=2, max_blocks_per_seq=4, block_size=4,
                            device=torch.device("cpu"))
    assert not buffers.fits(_decode_inputs(seqs, [1, 2, 3]))  # 3 sequences > 2
    assert buffers.fits(_decode_inputs(seqs, [1, 2]))
    prefill = build_step_inputs([SequenceChunk([1, 2], 0, [0], sample_id="0")], 4)
    assert not buffers.fits(prefill)


@pytest.mark.gpu
@torch.inference_mode()
def test_replay_matches_eager_on_gpu() -> None:
    model = _tiny_model("cuda", torch.bfloat16)
    prompts_ = [[3, 9, 27, 5, 11], [40, 2, 2], [7, 7, 60, 1, 14, 33, 2]]
    eager_seqs, graph_seqs = _prefilled(model, prompts_), _prefilled(model, prompts_)
    graphs = DecodeGraphs.capture(model, graph_seqs.kv_caches, max_num_seqs=8, max_model_len=16,
                                  block_size=4, device=torch.device("cuda"))
    assert sorted(graphs._graphs) == [1, 2, 4, 8]
    for tokens in ([12, 50, 8], [1, 2], [5, 6, 7]):
        step = _decode_inputs(eager_seqs, tokens)
        eager = model(step.input_ids, step.positions, eager_seqs.kv_caches, step.meta)
        replayed = graphs.replay(_decode_inputs(graph_seqs, tokens))
        assert replayed is not None
        # Padded rows may change cuBLAS's tiling: bf16 rounding, not exact equality.
        torch.testing.assert_close(replayed[:len(tokens)], eager, rtol=2e-2, atol=2e-2)
        for seqs in (eager_seqs, graph_seqs):
            for i in range(len(tokens)):
                seqs.num_computed[i] += 1
    for (k, v), (gk, gv) in zip(eager_seqs.kv_caches, graph_seqs.kv_caches, strict=True):
        torch.testing.assert_close(gk, k, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(gv, v, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_engine_tokens_same_with_and_without_graphs() -> None:
    """A random-weight model (no wheel to carry to the GPU machine), greedy through EngineCore."""
    model = _tiny_model("cuda", torch.bfloat16)
    tokenizer = Tokenizer(HFTokenizer(WordLevel({"<unk>": 0}, unk_token="<unk>")),
                          bos_token_id=None, eos_token_id=None)
    checkpoint = Checkpoint(config=model.config, model=model, tokenizer=tokenizer, model_id="tiny")
    prompt_ids = [[(7 * i + 3 * j) % 80 for j in range(5 + 3 * i)] for i in range(5)]

    def tokens(cuda_graphs: bool) -> dict[str, list[int]]:
        core = make_core(checkpoint, device="cuda", cuda_graphs=cuda_graphs, max_num_seqs=8,
                         max_model_len=48)
        assert (core.runner.decode_graphs is not None) == cuda_graphs
        return run(core, [EngineRequest(f"r{i}", p, greedy(16)) for i, p in enumerate(prompt_ids)])

    assert tokens(True) == tokens(False)


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_next", "qwen3_5"])
def test_hybrid_engine_tokens_same_with_and_without_graphs(model_type: str, tmp_path) -> None:
    """A hybrid model's decode steps replayed from graphs (state slots in a static buffer) give
    the tokens its eager steps give, over batches that shrink as requests finish."""
    import transformers
    checkpoint = load_checkpoint(save_hybrid_dir(transformers, model_type, tmp_path / model_type),
                                 device="cuda")
    prompt_ids = [[(7 * i + 3 * j) % 300 + 3 for j in range(5 + 3 * i)] for i in range(5)]

    def tokens(cuda_graphs: bool) -> dict[str, list[int]]:
        core = make_core(checkpoint, device="cuda", cuda_graphs=cuda_graphs, max_num_seqs=8,
                         max_model_len=64)
        assert (core.runner.decode_graphs is not None) == cuda_graphs
        return run(core, [EngineRequest(f"r{i}", p, greedy(8 + 2 * i))
                          for i, p in enumerate(prompt_ids)])

    assert tokens(True) == tokens(False)

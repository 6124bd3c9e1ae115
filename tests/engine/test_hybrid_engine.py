"""The engine core on tiny hybrid checkpoints: linear-attention state slots across batching, chunked
prefill, preemption and aborts; a KV pool sized for the full-attention layers only; decode work of
the linear layers that does not grow with the context."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
import transformers

from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineOutput, EngineRequest, FinishReason, SamplingParams
from engine.loading.loader import Checkpoint
from engine.runner.model_runner import kv_bytes_per_token
from tests.engine.helpers import RaisesAfterForward, run_all
from tests.engine.hybrid_models import LONG_PROMPT, hybrid_fixtures, reference_model

model_dir, checkpoint = hybrid_fixtures(["qwen3_next", "qwen3_5"], "hybrid-engine")


@pytest.fixture(scope="module")
def prompts(checkpoint: Checkpoint) -> list[list[int]]:
    ids = checkpoint.tokenizer.encode(LONG_PROMPT)
    # Ragged: one longer than a delta-rule chunk, two short ones.
    return [ids[:90], ids[100:107], ids[40:63]]


def make_core(checkpoint: Checkpoint, **overrides: object) -> EngineCore:
    overrides = {"kv_cache_bytes": 1 << 22} | overrides  # a few thousand tokens: plenty here
    return EngineCore(checkpoint, EngineConfig(model="in-memory", **overrides))  # type: ignore[arg-type]


def greedy(max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run(core: EngineCore, requests: list[EngineRequest]) -> dict[str, list[int]]:
    outputs = run_all(core, requests)
    for _, final in outputs.values():
        assert final.finish_reason is FinishReason.LENGTH, final
    return {request_id: tokens for request_id, (tokens, _) in outputs.items()}


@pytest.fixture(scope="module")
def sequential(checkpoint: Checkpoint, prompts: list[list[int]]) -> dict[str, list[int]]:
    core = make_core(checkpoint)
    result: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        result.update(run(core, [EngineRequest(f"r{i}", prompt, greedy())]))
    return result


@torch.inference_mode()
def test_sequential_greedy_matches_transformers(model_dir: Path, checkpoint: Checkpoint,
                                                prompts: list[list[int]],
                                                sequential: dict[str, list[int]]) -> None:
    reference = reference_model(transformers, checkpoint.config.model_type, model_dir)
    for i, prompt in enumerate(prompts):
        out = reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert sequential[f"r{i}"] == out[0, len(prompt):].tolist()


def test_batched_greedy_matches_sequential(checkpoint: Checkpoint, prompts: list[list[int]],
                                           sequential: dict[str, list[int]]) -> None:
    # A 24-token budget splits the long prompt over several steps, beside the others' decodes.
    core = make_core(checkpoint, max_num_batched_tokens=24)
    requests = [EngineRequest(f"r{i}", p, greedy()) for i, p in enumerate(prompts)]
    assert run(core, requests) == sequential
    assert core.stats.num_free_state_slots == core.stats.num_state_slots == 16


def test_a_row_that_raises_fails_alone_and_the_others_recompute_their_state(
        checkpoint: Checkpoint, prompts: list[list[int]], sequential: dict[str, list[int]]) -> None:
    """The failed step advanced every row's linear state before raising; the others are run again
    from a zero state up to the same point, so their tokens and logprobs are what they are without
    the failing request (a state advanced twice shows in the logprobs)."""
    used = {t for p in prompts for t in p} | {t for tokens in sequential.values() for t in tokens}
    marker = next(t for t in range(checkpoint.config.vocab_size) if t not in used)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)

    def outputs(with_bad: bool) -> dict[str, list[EngineOutput]]:
        core = make_core(checkpoint, max_num_batched_tokens=24)
        requests = [EngineRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]
        if with_bad:
            core.runner.forward = RaisesAfterForward(core.runner.forward, marker)  # type: ignore[method-assign]
            requests.insert(1, EngineRequest("bad", prompts[1][:3] + [marker], params))
        result: dict[str, list[EngineOutput]] = {r.request_id: [] for r in requests}
        for request in requests:
            core.add_request(request)
        while core.has_work():
            for out in core.step():
                result[out.request_id].append(out)
        assert core.stats.num_free_state_slots == core.stats.num_state_slots
        return result

    clean, hurt = outputs(with_bad=False), outputs(with_bad=True)
    bad = hurt.pop("bad")
    assert len(bad) == 1 and bad[0].finish_reason is FinishReason.ERROR and not bad[0].new_token_ids
    for request_id, expected in clean.items():
        got = hurt[request_id]
        assert [t for o in got for t in o.new_token_ids] == sequential[request_id]
        assert got[-1].finish_reason is FinishReason.LENGTH
        expected_logprobs = [lp.logprob for o in expected for lp in o.logprobs or []]
        assert [lp.logprob for o in got for lp in o.logprobs or []] == pytest.approx(expected_logprobs, abs=1e-4)


def test_preemption_restarts_state(checkpoint: Checkpoint, prompts: list[list[int]],
                                   sequential: dict[str, list[int]]) -> None:
    # 34 blocks of 4 tokens cannot hold all three prompts plus their outputs at once.
    core = make_core(checkpoint, block_size=4, num_kv_blocks=34)
    requests = [EngineRequest(f"r{i}", p, greedy()) for i, p in enumerate(prompts)]
    assert run(core, requests) == sequential
    assert core.stats.num_preemptions > 0
    assert core.state_slots is not None and core.state_slots.num_free == 16


def test_free_state_slots_cap_running_and_come_back(checkpoint: Checkpoint,
                                                    prompts: list[list[int]]) -> None:
    core = make_core(checkpoint, max_num_seqs=2)
    for i, prompt in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", prompt, greedy(max_tokens=20)))
    core.step()
    assert (core.stats.num_state_slots, core.stats.num_free_state_slots) == (2, 0)
    assert (core.stats.num_running, core.stats.num_waiting) == (2, 1)
    [aborted] = core.abort(["r0"])
    assert aborted.finish_reason is FinishReason.ABORT
    assert core.stats.num_free_state_slots == 1
    core.step()  # the waiting request takes the freed slot
    assert (core.stats.num_running, core.stats.num_free_state_slots) == (2, 0)
    finished = set()
    while core.has_work():
        finished |= {o.request_id for o in core.step() if o.finished}
    assert finished == {"r1", "r2"}
    assert core.stats.num_free_state_slots == 2
    assert core.kv_cache.num_free_blocks == core.stats.num_blocks


def test_prefix_caching_is_disabled_with_a_log_line(checkpoint: Checkpoint,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="helexa.engine"):
        core = make_core(checkpoint, enable_prefix_caching=True)
    assert not core.kv_cache.enable_prefix_caching
    assert any("prefix caching disabled" in r.getMessage() for r in caplog.records)


def test_kv_pool_covers_full_attention_layers_only(checkpoint: Checkpoint) -> None:
    config = checkpoint.config
    core = make_core(checkpoint, kv_cache_bytes=1 << 20)
    per_token = 2 * config.num_attention_layers * config.num_key_value_heads * config.head_dim * 4
    assert kv_bytes_per_token(config, torch.float32) == per_token
    assert config.num_attention_layers < config.num_hidden_layers
    assert core.stats.num_blocks == (1 << 20) // (per_token * 16)
    assert len(core.runner.kv_caches) == config.num_attention_layers
    states = core.runner.hybrid_caches.states
    linear_layers = config.num_hidden_layers - config.num_attention_layers
    assert len(states.recurrent) == len(states.conv) == linear_layers
    assert all(r.dtype == torch.float32 and r.shape[0] == 16 for r in states.recurrent)


def _decode_step_at(core: EngineCore, prompt: list[int]) -> tuple[dict[str, int], int]:
    """Prefill `prompt`, then count the FLOPs of each linear-attention layer in one decode step.
    Also returns the KV blocks the request holds, to show the context really differs."""
    # Imported here: it imports triton, which must not happen while pytest collects, before the
    # kernel tests choose Triton's interpreter.
    from torch.utils.flop_counter import FlopCounterMode

    core.add_request(EngineRequest("probe", prompt, greedy(max_tokens=3)))
    core.step()  # prefill (and the first token)
    with FlopCounterMode(display=False) as counter:
        core.step()  # one decode
    blocks = len(core.scheduler.requests["probe"].block_ids)
    while core.has_work():
        core.step()
    counts = {name.split(".", 1)[1]: sum(by_op.values())
              for name, by_op in counter.get_flop_counts().items() if name.endswith("linear_attn")}
    return counts, blocks


def test_linear_layer_decode_work_is_flat_in_context(checkpoint: Checkpoint) -> None:
    ids = checkpoint.tokenizer.encode(LONG_PROMPT)
    core = make_core(checkpoint, block_size=4)
    states = core.runner.hybrid_caches.states
    state_sizes = [t.numel() for t in states.conv + states.recurrent]
    short, short_blocks = _decode_step_at(core, ids[:8])
    long, long_blocks = _decode_step_at(core, ids[:200])
    assert long_blocks >= 10 * short_blocks  # the attention layers' context grew 25 times...
    assert short and all(count > 0 for count in short.values())
    assert long == short  # ...while each linear layer's decode did the same work
    assert [t.numel() for t in states.conv + states.recurrent] == state_sizes

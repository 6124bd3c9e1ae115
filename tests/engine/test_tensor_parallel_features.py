"""The engine's features at tensor_parallel 3 (gloo on CPU), on the tiny random llama of
`test_tensor_parallel`: continuous batching, prefix caching, chunked prefill, structured outputs
and cancellation each give the tokens one rank gives. One TP=3 group and one TP=1 reference serve
the whole module; prefill is chunked (`max_num_batched_tokens` 8) throughout."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.core.core_process import build_core
from engine.core.engine_core import EngineCore
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import (
    EngineOutput,
    EngineRequest,
    FinishReason,
    SamplingParams,
    StructuredOutput,
    StructuredOutputKind,
)
from tests.engine.test_tensor_parallel import engine_config, model_dir  # noqa: F401  (the shared tiny model)

CHUNK = 8
LONG = [11 + (7 * i) % 300 for i in range(30)]  # four prefill chunks of 8
SHORT = [5, 40, 100, 7, 9]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def config(model_dir: Path, world: int) -> EngineConfig:  # noqa: F811
    return dataclasses.replace(engine_config(model_dir, world), max_num_batched_tokens=CHUNK)


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> Iterator[EngineCore]:  # noqa: F811
    core = build_core(config(model_dir, 1))
    yield core
    core.close()


@pytest.fixture(scope="module")
def tp3(model_dir: Path) -> Iterator[EngineCore]:  # noqa: F811
    lost: list[str] = []
    core = build_core(config(model_dir, 3), on_rank_lost=lost.append)
    assert core.runner.tensor_parallel == 3
    yield core
    core.close()
    assert not lost, lost


def run(core: EngineCore, requests: dict[str, tuple[list[int], SamplingParams]],
        later: dict[int, list[str]] | None = None,
        abort_at: dict[int, list[str]] | None = None) -> tuple[dict[str, list[int]], dict[str, EngineOutput], int]:
    """Step `core` until it is idle: requests named in `later` join at that step, those in
    `abort_at` are aborted then. Each request's tokens, its last output, and the steps taken."""
    later, abort_at = later or {}, abort_at or {}
    joining = {rid for rids in later.values() for rid in rids}
    tokens: dict[str, list[int]] = {rid: [] for rid in requests}
    last: dict[str, EngineOutput] = {}
    for rid, (prompt, sampling) in requests.items():
        if rid not in joining:
            core.add_request(EngineRequest(rid, prompt, sampling))
    step = 0
    while core.has_work() or any(s >= step for s in later):
        for rid in later.get(step, []):
            core.add_request(EngineRequest(rid, *requests[rid]))
        outputs = core.step() + (core.abort(abort_at[step]) if step in abort_at else [])
        for out in outputs:
            assert out.error is None, out.error
            tokens[out.request_id].extend(out.new_token_ids)
            last[out.request_id] = out
        step += 1
    return tokens, last, step


def alone(core: EngineCore, prompt: list[int], sampling: SamplingParams = GREEDY) -> list[int]:
    return run(core, {"alone": (prompt, sampling)})[0]["alone"]


def test_continuous_batching_a_request_joining_mid_run(tp3: EngineCore, reference: EngineCore) -> None:
    tokens, _, _ = run(tp3, {"first": (LONG, GREEDY), "second": (SHORT, GREEDY)}, later={6: ["second"]})
    assert tokens == {"first": alone(reference, LONG), "second": alone(reference, SHORT)}


def test_prefix_caching_reuses_blocks_and_keeps_the_tokens(tp3: EngineCore, reference: EngineCore) -> None:
    prompt = [*LONG, 3, 4]
    alone(tp3, LONG)
    tokens, last, _ = run(tp3, {"again": (prompt, GREEDY)})
    assert last["again"].num_cached_tokens >= 24  # the long prompt's whole blocks
    assert tokens["again"] == alone(reference, prompt)


def test_chunked_prefill_takes_several_steps_and_keeps_the_tokens(tp3: EngineCore, reference: EngineCore) -> None:
    prompt = [17 + (5 * i) % 350 for i in range(33)]  # unseen: nothing cached
    tokens, _, steps = run(tp3, {"chunked": (prompt, GREEDY)})
    assert steps >= -(-len(prompt) // CHUNK) + GREEDY.max_tokens - 1  # prefill over at least 5 steps
    assert tokens["chunked"] == alone(reference, prompt)


def test_structured_output_holds_at_three_ranks(tp3: EngineCore, reference: EngineCore) -> None:
    choices = ["yes", "no", "maybe"]
    sampling = SamplingParams(max_tokens=12, temperature=0.0, structured=StructuredOutput(
        kind=StructuredOutputKind.CHOICE, spec=json.dumps(choices)))
    tokens, last, _ = run(tp3, {"constrained": (SHORT, sampling)})
    assert last["constrained"].finish_reason is FinishReason.STOP
    assert tp3.checkpoint.tokenizer.decode(tokens["constrained"]) in choices
    assert tokens["constrained"] == alone(reference, SHORT, sampling)


def test_cancelling_one_request_leaves_the_others_tokens(tp3: EngineCore, reference: EngineCore) -> None:
    tokens, last, _ = run(tp3, {"kept": (SHORT, GREEDY), "cancelled": (LONG, GREEDY)}, abort_at={5: ["cancelled"]})
    assert last["cancelled"].finish_reason is FinishReason.ABORT
    assert len(tokens["cancelled"]) < GREEDY.max_tokens
    assert tokens["kept"] == alone(reference, SHORT)
    assert tp3.runner.followers is not None and tp3.runner.followers.watch.lost is None

"""SimpleEngine end to end on SmolLM2: outputs, finish reasons, abort and error handling."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import torch
from torch import nn

from engine.api import EngineOutput, EngineRequest, FinishReason, SamplingOptions
from engine.loader import Checkpoint
from engine.simple_engine import SimpleEngine

TIMEOUT_S = 60


@contextlib.asynccontextmanager
async def running_engine(checkpoint: Checkpoint, **kwargs: int) -> AsyncIterator[SimpleEngine]:
    engine = SimpleEngine(checkpoint, **kwargs)
    try:
        yield engine
    finally:
        await engine.shutdown()


async def collect(engine: SimpleEngine, request: EngineRequest) -> list[EngineOutput]:
    async with asyncio.timeout(TIMEOUT_S):
        return [out async for out in engine.generate(request)]


def request(prompt: list[int], request_id: str = "r1", **sampling: object) -> EngineRequest:
    sampling.setdefault("max_tokens", 8)
    sampling.setdefault("temperature", 0.0)
    return EngineRequest(request_id, prompt, SamplingOptions(**sampling))


def tokens(outputs: list[EngineOutput]) -> list[int]:
    return [t for out in outputs for t in out.new_token_ids]


@torch.inference_mode()
def plain_greedy(model: nn.Module, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Recompute the whole sequence each step: no KV cache, nothing shared with the engine."""
    ids = list(prompt)
    while len(ids) - len(prompt) < max_tokens:
        ids.append(int(model(torch.tensor(ids), torch.arange(len(ids)))[-1].argmax()))
        if ids[-1] == eos:
            break
    return ids[len(prompt):]


@pytest.mark.asyncio
async def test_greedy_matches_plain_loop(smollm2: Checkpoint, chat_prompt_ids: list[int]) -> None:
    expected = plain_greedy(smollm2.model, chat_prompt_ids, 12, smollm2.tokenizer.eos_token_id)
    async with running_engine(smollm2) as engine:
        outputs = await collect(engine, request(chat_prompt_ids, max_tokens=12))
    assert tokens(outputs) == expected
    assert all(len(out.new_token_ids) == 1 for out in outputs)
    assert outputs[0].num_prompt_tokens == len(chat_prompt_ids) and outputs[0].prefill_ms > 0
    assert [out.finished for out in outputs] == [False] * (len(outputs) - 1) + [True]
    stopped = expected[-1] == smollm2.tokenizer.eos_token_id
    assert outputs[-1].finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)


@pytest.mark.asyncio
async def test_max_tokens_finishes_with_length(smollm2: Checkpoint,
                                               chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2) as engine:
        assert engine.free_slots() == 1
        outputs = await collect(engine, request(chat_prompt_ids, max_tokens=3, ignore_eos=True))
        assert engine.free_slots() == 1
    assert len(tokens(outputs)) == 3
    assert outputs[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.asyncio
async def test_max_model_len_finishes_with_length(smollm2: Checkpoint,
                                                  chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2, max_model_len=len(chat_prompt_ids) + 2) as engine:
        outputs = await collect(engine, request(chat_prompt_ids, max_tokens=10, ignore_eos=True))
    assert len(tokens(outputs)) == 2
    assert outputs[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.asyncio
async def test_stop_token_ids(smollm2: Checkpoint, chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2) as engine:
        greedy_request = request(chat_prompt_ids, max_tokens=4, ignore_eos=True)
        greedy = tokens(await collect(engine, greedy_request))
        outputs = await collect(engine, request(chat_prompt_ids, "r2", max_tokens=4,
                                                stop_token_ids=[greedy[1]]))
    assert tokens(outputs) == greedy[:2]
    assert outputs[-1].finish_reason == FinishReason.STOP


@pytest.mark.asyncio
async def test_seeded_sampling_is_reproducible(smollm2: Checkpoint,
                                               chat_prompt_ids: list[int]) -> None:
    sampling = dict(max_tokens=8, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    async with running_engine(smollm2) as engine:
        first = tokens(await collect(engine, request(chat_prompt_ids, "a", **sampling)))
        second = tokens(await collect(engine, request(chat_prompt_ids, "b", **sampling)))
    assert first == second and len(first) == 8


@pytest.mark.asyncio
async def test_abort_stops_generation(smollm2: Checkpoint, chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2) as engine:
        outputs: list[EngineOutput] = []
        async with asyncio.timeout(TIMEOUT_S):
            async for out in engine.generate(request(chat_prompt_ids, max_tokens=1000,
                                                     ignore_eos=True)):
                outputs.append(out)
                if len(outputs) == 3:
                    assert engine.free_slots() == 0
                    await engine.abort("r1")
                    await engine.abort("r1")  # idempotent
        await engine.abort("unknown")  # no-op
        assert engine.free_slots() == 1
    assert outputs[-1].finished and outputs[-1].finish_reason == FinishReason.ABORT
    assert outputs[-1].new_token_ids == []
    # The worker checks between steps; a couple of tokens may already be on their way.
    assert len(tokens(outputs)) < 10


@pytest.mark.asyncio
async def test_bad_token_id_becomes_error(smollm2: Checkpoint, chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2) as engine:
        outputs = await collect(engine, request([1, 10**9]))
        assert len(outputs) == 1 and outputs[0].finish_reason == FinishReason.ERROR
        assert outputs[0].finished and "IndexError" in outputs[0].error
        # The worker survives and serves the next request.
        next_request = request(chat_prompt_ids, "r2", max_tokens=2, ignore_eos=True)
        outputs = await collect(engine, next_request)
    assert outputs[-1].finish_reason == FinishReason.LENGTH


@pytest.mark.asyncio
async def test_prompt_longer_than_max_model_len(smollm2: Checkpoint) -> None:
    async with running_engine(smollm2, max_model_len=8) as engine:
        outputs = await collect(engine, request(list(range(20, 29))))
    assert outputs[-1].finish_reason == FinishReason.ERROR
    assert "max_model_len" in outputs[-1].error


class _Exploding(nn.Module):
    def forward(self, *args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("boom")


@pytest.mark.asyncio
async def test_model_exception_becomes_error(smollm2: Checkpoint,
                                             chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2) as engine:
        real_model = engine.model
        engine.model = _Exploding()
        engine.model.new_kv_cache = real_model.new_kv_cache
        outputs = await collect(engine, request(chat_prompt_ids))
    assert [out.finish_reason for out in outputs] == [FinishReason.ERROR]
    assert outputs[0].error == "RuntimeError: boom"


@pytest.mark.asyncio
async def test_after_shutdown_requests_fail_fast(smollm2: Checkpoint,
                                                 chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2) as engine:
        pass
    outputs = await collect(engine, request(chat_prompt_ids))
    assert outputs[0].finish_reason == FinishReason.ERROR and "shut down" in outputs[0].error
    assert engine.free_slots() == 0


@pytest.mark.asyncio
async def test_concurrent_requests_run_one_after_another(smollm2: Checkpoint,
                                                         chat_prompt_ids: list[int]) -> None:
    async with running_engine(smollm2) as engine:
        single = tokens(await collect(engine, request(chat_prompt_ids, "solo", max_tokens=4)))
        both = await asyncio.gather(collect(engine, request(chat_prompt_ids, "a", max_tokens=4)),
                                    collect(engine, request(chat_prompt_ids, "b", max_tokens=4)))
    assert [tokens(outputs) for outputs in both] == [single, single]
    assert all(out.request_id == "b" for out in both[1])

"""The engine core in its own process, driven from asyncio: stream, coalesce, abort, survive."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from engine.frontend.core_client import AsyncEngine
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import EngineOutput, EngineRequest, FinishReason, SamplingParams, StepOutputs
from engine.loading.default_model import default_model_path
from engine.loading.loader import Checkpoint


@pytest.fixture
async def engine() -> AsyncEngine:
    engine = await AsyncEngine.start(EngineConfig(model=str(default_model_path()), max_num_seqs=4))
    try:
        yield engine
    finally:
        await engine.shutdown()


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def collect(engine: AsyncEngine, request: EngineRequest) -> list[EngineOutput]:
    return [out async for out in engine.generate(request)]


async def test_streams_the_same_tokens_as_the_in_process_core(engine: AsyncEngine, smollm2: Checkpoint,
                                                               chat_prompt_ids: list[int]) -> None:
    from engine.core.engine_core import EngineCore

    core = EngineCore(smollm2, EngineConfig(model="in-memory"))
    core.add_request(EngineRequest("ref", chat_prompt_ids, greedy(10)))
    expected = []
    while core.has_work():
        expected += [t for out in core.step() for t in out.new_token_ids]

    outputs = await collect(engine, EngineRequest("a", chat_prompt_ids, greedy(10)))
    assert [t for out in outputs for t in out.new_token_ids] == expected
    assert outputs[-1].finished and outputs[-1].finish_reason is FinishReason.LENGTH
    assert outputs[0].prefill_ms is not None and outputs[0].num_prompt_tokens == len(chat_prompt_ids)
    assert engine.free_slots() == 4


async def test_a_slow_consumer_gets_coalesced_deltas(engine: AsyncEngine, chat_prompt_ids: list[int]) -> None:
    outputs = []
    async for out in engine.generate(EngineRequest("slow", chat_prompt_ids, greedy(24))):
        outputs.append(out)
        if len(outputs) == 1:
            # Stop consuming until the engine has certainly finished everything.
            while engine.stats.generated_tokens < 24:
                await asyncio.sleep(0.01)
    assert sum(len(o.new_token_ids) for o in outputs) == 24
    assert len(outputs) == 2, "everything produced while we were away arrives as one output"


async def test_abort_ends_the_stream_and_frees_the_pool(engine: AsyncEngine, chat_prompt_ids: list[int]) -> None:
    outputs = []
    async for out in engine.generate(EngineRequest("long", chat_prompt_ids, greedy(500))):
        outputs.append(out)
        if len(outputs) == 3:
            await engine.abort("long")
    assert outputs[-1].finish_reason is FinishReason.ABORT
    assert sum(len(o.new_token_ids) for o in outputs) < 500
    # The next step's stats show every block back in the pool.
    await collect(engine, EngineRequest("next", chat_prompt_ids, greedy(1)))
    assert engine.stats.num_free_blocks == engine.info.num_blocks


async def test_breaking_out_of_the_stream_aborts(engine: AsyncEngine, chat_prompt_ids: list[int]) -> None:
    async for _ in engine.generate(EngineRequest("left", chat_prompt_ids, greedy(500))):
        break
    outputs = await collect(engine, EngineRequest("after", chat_prompt_ids, greedy(2)))
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats.num_running == 0 and engine.stats.num_free_blocks == engine.info.num_blocks


async def test_a_dead_core_fails_requests_instead_of_hanging(engine: AsyncEngine, chat_prompt_ids: list[int]) -> None:
    stream = engine.generate(EngineRequest("doomed", chat_prompt_ids, greedy(500)))
    await stream.__anext__()
    os.kill(engine._process.pid, signal.SIGKILL)
    rest = [out async for out in stream]
    assert rest[-1].finish_reason is FinishReason.ERROR
    later = await collect(engine, EngineRequest("later", chat_prompt_ids, greedy(2)))
    assert later[-1].finish_reason is FinishReason.ERROR
    assert engine.free_slots() == 0


async def test_a_hung_core_is_killed_and_fails_its_requests_instead_of_hanging(chat_prompt_ids: list[int]) -> None:
    """A core that is alive but makes no step (SIGSTOP: as a device or kernel that never returns)
    sends nothing and its pipe never closes; past `stall_s` of silence with a request unfinished
    the client kills it, and the request ends with an error output like any dead core's."""
    engine = await AsyncEngine.start(EngineConfig(model=str(default_model_path()), max_num_seqs=4, stall_s=3.0,
                                                  pulse_s=0.5))
    died = asyncio.Event()
    engine.on_death = lambda held: died.set()
    try:
        # Long idle first (as if the core had said nothing for longer than the bound while it had
        # no work): the first request after it is not taken for a stall.
        engine._heard_at -= 60.0
        idle = await collect(engine, EngineRequest("idle-before", chat_prompt_ids, greedy(2)))
        assert idle[-1].finish_reason is FinishReason.LENGTH and not engine.stalled
        stream = engine.generate(EngineRequest("stuck", chat_prompt_ids, greedy(500)))
        await stream.__anext__()
        os.kill(engine._process.pid, signal.SIGSTOP)
        rest = [out async for out in stream]
        assert rest[-1].finish_reason is FinishReason.ERROR
        await asyncio.wait_for(died.wait(), 30)
        assert engine.stalled and engine.exitcode in (None, -signal.SIGKILL)
    finally:
        await engine.shutdown()


async def test_a_core_busy_with_a_long_prefill_is_heard_from_between_its_steps(chat_prompt_ids: list[int]) -> None:
    """Steps that finish no output (a long prompt prefilled 16 tokens a step: 50 steps) still
    pulse, at least every `pulse_s`: a core at work is never silent for longer than a step, so
    only a step that never ends (or one past `stall_s`) is taken for a hang."""
    engine = await AsyncEngine.start(EngineConfig(model=str(default_model_path()), max_num_seqs=4,
                                                  max_num_batched_tokens=16, pulse_s=0.01))
    pulses = 0
    dispatch = engine._dispatch

    def counted(message: StepOutputs) -> None:
        nonlocal pulses
        pulses += not message.outputs
        dispatch(message)

    engine._dispatch = counted  # type: ignore[method-assign]
    try:
        outputs = await collect(engine, EngineRequest("long", (chat_prompt_ids * 100)[:800], greedy(1)))
        assert outputs[-1].finish_reason is FinishReason.LENGTH, outputs[-1]
        assert pulses > 0 and not engine.stalled
    finally:
        await engine.shutdown()


def test_merged_outputs_concatenate_tokens_and_keeps_first_prefill() -> None:
    a = EngineOutput("r", [1], num_prompt_tokens=5, prefill_ms=3.0)
    b = EngineOutput("r", [2, 3], finished=True, finish_reason=FinishReason.STOP, num_prompt_tokens=5)
    merged = a.merged(b)
    assert merged.new_token_ids == [1, 2, 3]
    assert merged.finished and merged.finish_reason is FinishReason.STOP and merged.prefill_ms == 3.0


async def test_a_rejected_request_reaches_the_client_and_the_core_stays_up(
        engine: AsyncEngine, smollm2: Checkpoint, chat_prompt_ids: list[int]) -> None:
    vocab = smollm2.config.vocab_size
    (out,) = await collect(engine, EngineRequest("outside", [1, vocab + 5], greedy(4)))
    assert out.finished and out.finish_reason is FinishReason.ERROR and "outside the vocabulary" in out.error
    after = await collect(engine, EngineRequest("after", chat_prompt_ids, greedy(3)))
    assert after[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in after) == 3


async def test_a_duplicate_id_is_refused_and_the_first_stream_goes_on(engine: AsyncEngine,
                                                                      chat_prompt_ids: list[int]) -> None:
    first = engine.generate(EngineRequest("twice", chat_prompt_ids, greedy(8)))
    outputs = [await first.__anext__()]
    (refused,) = await collect(engine, EngineRequest("twice", chat_prompt_ids, greedy(8)))
    assert refused.finish_reason is FinishReason.ERROR and "duplicate" in refused.error
    outputs += [out async for out in first]
    assert outputs[-1].finish_reason is FinishReason.LENGTH
    assert sum(len(o.new_token_ids) for o in outputs) == 8


async def test_a_request_is_sent_when_generate_is_called_not_when_read(engine: AsyncEngine,
                                                                      chat_prompt_ids: list[int]) -> None:
    stream = engine.generate(EngineRequest("eager", chat_prompt_ids, greedy(6)))
    # Not read yet, and the core generates it all the same (its step stats say so).
    await asyncio.wait_for(_until(lambda: engine.stats.generated_tokens >= 6), timeout=60)
    outputs = [out async for out in stream]
    assert sum(len(o.new_token_ids) for o in outputs) == 6
    assert outputs[-1].finish_reason is FinishReason.LENGTH


async def test_closing_a_stream_never_read_aborts_its_request(engine: AsyncEngine,
                                                              chat_prompt_ids: list[int]) -> None:
    stream = engine.generate(EngineRequest("unread", chat_prompt_ids, greedy(500)))
    await stream.aclose()
    await stream.aclose()  # closing twice is closing once
    assert [out async for out in stream] == []
    after = await collect(engine, EngineRequest("after", chat_prompt_ids, greedy(2)))
    assert after[-1].finish_reason is FinishReason.LENGTH
    assert engine.stats.num_running == 0 and engine.stats.num_free_blocks == engine.info.num_blocks


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_a_large_request_to_a_busy_core_never_blocks_the_event_loop() -> None:
    """A core in a long step reads nothing; its pipe holds ~64 KiB. Sending a request of a few MiB
    must not wait on the loop for the core to read it (heartbeats and acks run there)."""
    import multiprocessing
    import threading

    from engine.frontend.engine_config import EngineConfig
    from engine.frontend.protocol import AddRequest, CoreInfo, to_core_decoder

    worker_end, core_end = multiprocessing.Pipe(duplex=True)
    engine = AsyncEngine(EngineConfig(model="unused"))
    engine._attach(worker_end, CoreInfo(model_id="m", max_model_len=1 << 20, max_num_seqs=4, num_blocks=0,
                                        block_size=16))
    prompt = list(range(1, 500_000))  # ~1.5 MiB of msgpack
    sent, stalled = threading.Event(), threading.Event()
    received: list[bytes] = []

    def busy_core() -> None:
        # Busy for 5 s, then it reads; had generate() waited for that, the loop stalled meanwhile.
        if not sent.wait(5.0):
            stalled.set()
        received.append(core_end.recv_bytes())

    core = threading.Thread(target=busy_core)
    core.start()
    engine.generate(EngineRequest("big", prompt, greedy(4)))  # on the loop, as the worker calls it
    sent.set()
    await asyncio.to_thread(core.join, 30)
    assert not stalled.is_set(), "generate() waited for the core to read its request"
    # The core, once free, reads the request whole.
    message = to_core_decoder.decode(received[0])
    assert isinstance(message, AddRequest) and message.request.prompt_token_ids == prompt
    engine._outbox.put(None)
    core_end.close()

"""A run's choices reach the engine before the worker awaits anything: each await lets the worker's
other requests take their turn first, and a burst's requests then reached the engine's batch spread
over milliseconds."""

from __future__ import annotations

import asyncio
import time

from apps.bus import wire
from apps.worker import choices
from apps.worker.prompt import Prompt
from apps.worker.replies import CollectingReplier
from apps.worker.run_record import RunRecord
from engine.frontend.protocol import EngineOutput, EngineRequest, FinishReason, SamplingParams


class LoggingEngine:
    """Says when each request was submitted and when its stream was read; one token each."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.more_arriving: list[bool] = []

    def generate(self, request: EngineRequest) -> Outputs:
        self.log.append(f"submit {request.request_id}")
        self.more_arriving.append(request.more_arriving)
        return Outputs(self, request.request_id)


class Outputs:
    def __init__(self, engine: LoggingEngine, request_id: str) -> None:
        self.engine, self.request_id, self.done = engine, request_id, False

    def __aiter__(self) -> Outputs:
        return self

    async def __anext__(self) -> EngineOutput:
        self.engine.log.append(f"read {self.request_id}")
        await asyncio.sleep(0)
        if self.done:
            raise StopAsyncIteration
        self.done = True
        return EngineOutput(self.request_id, [42], finished=True, finish_reason=FinishReason.LENGTH)

    async def aclose(self) -> None:
        pass


def run(engine: LoggingEngine, n: int, arriving: int = 0) -> list[FinishReason]:
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="-",
                                   sampling=SamplingParams(max_tokens=1, n=n), arriving=arriving)
    record = RunRecord(request=request, node="n", attempt=1, received_at=time.time())

    async def go() -> list[FinishReason]:
        reasons, error = await choices.generate(engine, FakeTokenizer(), CollectingReplier(attempt=1, node="n"),
                                                record, Prompt(token_ids=[1, 2, 3]), request.sampling)
        assert error is None
        return reasons

    return asyncio.run(go())


class FakeTokenizer:
    eos_token_id = 0
    all_stop_token_ids = [0]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"<{i}>" for i in ids)


def test_every_choice_is_submitted_before_any_stream_is_read() -> None:
    engine = LoggingEngine()
    assert run(engine, 3) == [FinishReason.LENGTH] * 3
    submits = [i for i, line in enumerate(engine.log) if line.startswith("submit")]
    reads = [i for i, line in enumerate(engine.log) if line.startswith("read")]
    assert len(submits) == 3 and reads and max(submits) < min(reads), engine.log


def test_the_engine_is_told_what_follows_each_choice() -> None:
    alone = LoggingEngine()
    run(alone, 3)
    assert alone.more_arriving == [True, True, False]  # the run's own other choices, then nothing
    announced = LoggingEngine()
    run(announced, 2, arriving=5)  # the gateway was reading five more requests
    assert announced.more_arriving == [True, True]

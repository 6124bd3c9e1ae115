"""How an attempt ends when part of it fails, through the worker's `run_request` with the scripted
engine on real NATS servers: a frame too large for the bus ends the attempt with the error frame
that replaced it (nothing follows, the ledger records an error); a choice that raises stops its
sibling choices with it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from apps.bus import connection, wire
from apps.bus.codes import ErrorCode, RunStatus
from apps.embedded.nats_server import NatsServer
from apps.settings import WorkerSettings
from apps.worker import choices
from apps.worker.model_loop import ModelLoop
from apps.worker.replies import CollectingReplier, Replier
from apps.worker.run import ServedModel, run_request
from engine.frontend.protocol import SamplingParams
from engine.frontend.scripted import ScriptedEngine
from engine.frontend.tokenizer import Tokenizer

MODEL = "ends-model"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
# The reply server's limit; the tool call below is past it, the text around it well within.
SMALL_PAYLOAD = 16 << 10
REPLY = ('Calling. <tool_call>{"name": "f", "arguments": {"x": "' + "a" * (SMALL_PAYLOAD + 4096)
         + '"}}</tool_call> and text after the call.')


@pytest.fixture
async def js(nats_server: NatsServer) -> AsyncIterator[JetStreamContext]:
    nc = await nats.connect(nats_server.url)  # the runs' events go to the session's bus
    try:
        yield nc.jetstream()
    finally:
        await nc.close()


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(tmp_path / "small", max_payload=SMALL_PAYLOAD) as server:
        yield server


def served(tmp_path: Path, tok: Tokenizer, script: dict[str, Any]) -> ServedModel:
    path = tmp_path / "script.json"
    path.write_text(json.dumps(script), encoding="utf-8")
    return ModelLoop(WorkerSettings(), ScriptedEngine(path, tok, MODEL), tok, MODEL).model


def chat(sampling: SamplingParams, **fields: Any) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id="r", model=MODEL, reply_subject="_INBOX.ends", sampling=sampling,
                                messages=[wire.ChatMessage(role="user", content="go")], **fields)


async def test_a_frame_too_large_for_the_bus_ends_the_attempt_with_its_error(
        tmp_path: Path, tok: Tokenizer, js: JetStreamContext, small_server: NatsServer) -> None:
    model = served(tmp_path, tok, {"default": REPLY})
    nc = await connection.connect(small_server.url, "ends-test")
    try:
        frames: list[wire.ReplyFrame] = []

        async def on_frame(msg: Msg) -> None:
            frames.append(wire.frame_decoder.decode(msg.data))

        await nc.subscribe("_INBOX.ends", cb=on_frame)
        replier = Replier(nc, "_INBOX.ends", attempt=1, node="n")
        outcome = await run_request(model, chat(SamplingParams(max_tokens=8000), tools=TOOLS), replier,
                                    attempt=1, node="n", js=js)
        await nc.flush()  # every frame the run handed on has reached the server, and so this subscriber
    finally:
        await nc.close()
    assert (outcome.finished.status, outcome.finished.error) == (RunStatus.ERROR, ErrorCode.REPLY_TOO_LARGE)
    assert isinstance(frames[-1], wire.ErrorFrame) and frames[-1].code == ErrorCode.GENERATION_FAILED
    assert [type(f) for f in frames].count(wire.ErrorFrame) == 1 and not any(isinstance(f, wire.Final) for f in frames)
    assert "text after" not in "".join(f.text for f in frames if isinstance(f, wire.Delta))


async def test_a_choice_that_raises_stops_its_siblings(
        tmp_path: Path, tok: Tokenizer, js: JetStreamContext, monkeypatch: pytest.MonkeyPatch) -> None:
    model = served(tmp_path, tok, {"rules": [{"match": "", "reply": "one two three four five six seven eight",
                                              "token_delay_s": 0.05}]})
    fed = 0
    real_feed = choices.ChoiceText.feed_counting_reasoning

    def failing_feed(self: choices.ChoiceText, token_ids: list[int]) -> Any:
        nonlocal fed
        fed += 1
        if fed == 3:  # both choices are under way by now
            raise RuntimeError("a detokenizer bug")
        return real_feed(self, token_ids)

    monkeypatch.setattr(choices.ChoiceText, "feed_counting_reasoning", failing_feed)
    replier = CollectingReplier(attempt=1, node="n")
    outcome = await run_request(model, chat(SamplingParams(n=2, max_tokens=50)), replier, attempt=1, node="n", js=js)
    assert (outcome.finished.status, outcome.finished.error) == (RunStatus.ERROR, "RuntimeError")
    left = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "generate_choice"]  # type: ignore[union-attr]
    assert left == [], "a sibling choice was left running"

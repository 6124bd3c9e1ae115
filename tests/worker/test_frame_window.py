"""A stream's text frames coalesce within the worker's frame window (apps/worker/replies.py): the
first token goes out alone and at once, the tokens after it share frames, a choice's end, a tool
call and the final frame flush what is held, and the text and token ids the client gets are the
ones it would get frame by frame. Frames go through a real NATS server."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from apps.bus import connection, wire
from apps.bus.codes import ErrorCode, FinishReason
from apps.embedded.nats_server import NatsServer
from apps.worker.replies import Replier
from tests.support import eventually_async
from tests.worker.in_process import listen

SUBJECT = "_INBOX.frame-window"


@pytest.fixture
async def frames(tmp_path: Path):  # type: ignore[no-untyped-def]
    with NatsServer(tmp_path / "nats") as server:
        nc = await connection.connect(server.url, "frame-window-test", max_reconnect_attempts=0)
        collected = await listen(nc, SUBJECT)
        await nc.flush()
        try:
            yield nc, collected.frames, collected.ended
        finally:
            await nc.close()


async def everything_sent_arrived(nc: NatsClient, got: list[wire.ReplyFrame]) -> None:
    """Publishes a marker after everything sent so far and waits for it: once it arrives, nothing
    more sent before it is coming."""
    await nc.flush()
    marker = Replier(nc, SUBJECT, attempt=9, node="n")
    await marker.heartbeat()
    await nc.flush()
    await eventually_async(lambda: any(isinstance(f, wire.Heartbeat) and f.attempt == 9 for f in got), 10)


def deltas(got: list[wire.ReplyFrame], index: int = 0) -> list[wire.Delta]:
    return [frame for frame in got if isinstance(frame, wire.Delta) and frame.index == index]


async def test_tokens_within_the_window_share_a_frame_and_the_first_goes_alone(
        frames: tuple[NatsClient, list[wire.ReplyFrame], asyncio.Event]) -> None:
    nc, got, final = frames
    # A window far longer than the loop below takes: everything after the first token is held.
    replier = Replier(nc, SUBJECT, attempt=1, node="n", frame_window=60.0)
    for token in range(100):
        await replier.delta(f"t{token} ", 1, token_ids=[token])
    await everything_sent_arrived(nc, got)
    first_sent = list(got)
    await replier.delta("", 0, finish_reason=FinishReason.STOP)
    await replier.final(FinishReason.STOP, wire.Usage(prompt_tokens=3, completion_tokens=100))
    await asyncio.wait_for(final.wait(), 10)
    # The first token was sent before any other was asked for: it never waits for the window.
    assert [(d.text, d.token_ids) for d in deltas(first_sent)] == [("t0 ", [0])]
    sent = deltas(got)
    assert len(sent) == 2, [d.num_tokens for d in sent]
    assert "".join(d.text for d in sent) == "".join(f"t{token} " for token in range(100))
    assert [t for d in sent for t in d.token_ids] == list(range(100))
    assert sum(d.num_tokens for d in sent) == 100
    assert sent[-1].finish_reason == FinishReason.STOP
    ours = [frame for frame in got if frame.attempt == 1]
    assert [frame.seq for frame in ours] == list(range(len(ours)))


async def test_held_text_goes_out_when_the_window_closes(
        frames: tuple[NatsClient, list[wire.ReplyFrame], asyncio.Event]) -> None:
    nc, got, _ = frames
    replier = Replier(nc, SUBJECT, attempt=1, node="n", frame_window=1.0)
    for token in range(5):
        await replier.delta(str(token), 1, token_ids=[token])
    # Nothing else is sent: only the window's own timer can deliver the held tokens.
    await eventually_async(lambda: "".join(d.text for d in deltas(got)) == "01234", 10,
                           message=lambda: f"held text never sent: {deltas(got)}")
    assert [d.token_ids for d in deltas(got)] == [[0], [1, 2, 3, 4]]


async def test_a_tool_call_and_each_choice_keep_their_own_frames(
        frames: tuple[NatsClient, list[wire.ReplyFrame], asyncio.Event]) -> None:
    nc, got, final = frames
    replier = Replier(nc, SUBJECT, attempt=1, node="n", frame_window=60.0)
    await replier.delta("a", 1, index=0, token_ids=[1])
    await replier.delta("b", 1, index=1, token_ids=[2])
    await replier.delta("c", 1, index=0, token_ids=[3])
    await replier.delta("d", 1, index=1, token_ids=[4])
    call = wire.ToolCallDelta(index=0, id="call_1", name="f", arguments="{}")
    await replier.delta("", 1, index=0, tool_calls=[call], token_ids=[5])
    await replier.delta("", 0, index=0, finish_reason=FinishReason.TOOL_CALLS)
    await replier.delta("e", 1, index=1, token_ids=[6], finish_reason=FinishReason.LENGTH)
    await replier.final(FinishReason.TOOL_CALLS, wire.Usage(prompt_tokens=1, completion_tokens=6))
    await asyncio.wait_for(final.wait(), 10)
    first, second = deltas(got, 0), deltas(got, 1)
    assert "".join(d.text for d in first) == "ac" and "".join(d.text for d in second) == "bde"
    assert [t for d in first for t in d.token_ids] == [1, 3, 5]
    assert [t for d in second for t in d.token_ids] == [2, 4, 6]
    # The tool call rides with the text held before it, never ahead of it.
    (with_call,) = [d for d in first if d.tool_calls]
    assert with_call.tool_calls == [call] and with_call.text == "c"
    assert first[-1].finish_reason == FinishReason.TOOL_CALLS and second[-1].finish_reason == FinishReason.LENGTH
    assert isinstance(got[-1], wire.Final)


async def test_a_silenced_attempt_drops_what_it_held(
        frames: tuple[NatsClient, list[wire.ReplyFrame], asyncio.Event]) -> None:
    nc, got, _ = frames
    replier = Replier(nc, SUBJECT, attempt=1, node="n", frame_window=60.0)
    await replier.delta("sent", 1, token_ids=[1])
    await replier.delta("held", 1, token_ids=[2])
    assert replier.sent_tokens
    replier.silence(ErrorCode.ATTEMPT_TAKEN)
    await replier.final(FinishReason.STOP, wire.Usage(prompt_tokens=1, completion_tokens=2))
    await everything_sent_arrived(nc, got)
    assert [d.text for d in deltas(got)] == ["sent"]


async def test_nothing_follows_an_attempts_last_frame(
        frames: tuple[NatsClient, list[wire.ReplyFrame], asyncio.Event]) -> None:
    """A heartbeat or text that races the end of an attempt (a stopping worker's error frame while
    the run's keep-alive ticks) does not reach the client after the error or final frame."""
    nc, got, _ = frames
    replier = Replier(nc, SUBJECT, attempt=1, node="n")
    await replier.delta("sent", 1, token_ids=[1])
    await replier.error(503, ErrorCode.WORKER_STOPPING, "stopping")
    await replier.heartbeat()
    await replier.delta("late", 1, token_ids=[2])
    await replier.final(FinishReason.STOP, wire.Usage(prompt_tokens=1, completion_tokens=2))
    await everything_sent_arrived(nc, got)
    of_attempt = [f for f in got if f.attempt == 1]
    assert [type(f) for f in of_attempt] == [wire.Delta, wire.ErrorFrame]

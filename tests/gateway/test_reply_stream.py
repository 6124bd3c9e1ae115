"""The reply stream on a real NATS server: frames in order per attempt, a gap or a repeat in an
attempt's sequence is an error, a migrated request drops the attempts before it, and a bounded
buffer cancels the request instead of holding frames for a client that reads too slowly."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
from nats.aio.client import Client as NatsClient

from apps.bus import connection, wire
from apps.bus.codes import ErrorCode, ServingError
from apps.embedded.nats_server import NatsServer
from apps.gateway.reply_stream import DEFAULT_MAX_FRAMES, ReplyStream, ReplyTimeout


def delta(seq: int, text: str, attempt: int = 1) -> bytes:
    return wire.encode(wire.Delta(seq=seq, attempt=attempt, text=text, num_tokens=1))


@contextlib.asynccontextmanager
async def subscribed(nats: NatsServer, max_frames: int = DEFAULT_MAX_FRAMES,
                     on_overflow: Callable[[], None] | None = None
                     ) -> AsyncIterator[tuple[NatsClient, str, ReplyStream]]:
    """A connection, an inbox and a ReplyStream listening on it."""
    nc = await connection.connect(nats.url, "test")
    try:
        reply = ReplyStream(max_frames, on_overflow)
        inbox = nc.new_inbox()
        reply.subscriptions.append(await nc.subscribe(inbox, cb=reply.on_message))
        yield nc, inbox, reply
    finally:
        await nc.close()


async def test_frames_come_in_order_and_a_later_attempt_is_ignored_once_locked(own_nats: NatsServer) -> None:
    async with subscribed(own_nats) as (nc, inbox, reply):
        for data in (delta(0, "a"), delta(1, "b")):
            await nc.publish(inbox, data)
        assert [(await reply.next(5)).text for _ in range(2)] == ["a", "b"]
        reply.lock()
        await nc.publish(inbox, delta(0, "again", attempt=2))
        await nc.publish(inbox, delta(2, "c"))
        assert (await reply.next(5)).text == "c"
        with pytest.raises(ReplyTimeout):
            await reply.next(0.2)
        await reply.close()


@pytest.mark.parametrize("sequence", [[0, 2], [0, 1, 1]], ids=["missing", "repeated"])
async def test_a_gap_in_an_attempts_sequence_is_lost_frames(own_nats: NatsServer, sequence: list[int]) -> None:
    async with subscribed(own_nats) as (nc, inbox, reply):
        for seq in sequence:
            await nc.publish(inbox, delta(seq, f"t{seq}"))
        for _ in sequence[:-1]:
            await reply.next(5)
        with pytest.raises(ServingError) as failed:
            await reply.next(5)
        assert failed.value.code == ErrorCode.FRAMES_LOST and failed.value.status == 502
        await reply.close()


@pytest.mark.parametrize("first", [[(1, 2)], [(1, 0), (2, 1)]], ids=["first-attempt", "redelivery"])
async def test_an_attempt_whose_first_frames_were_lost_is_lost_frames(own_nats: NatsServer,
                                                                      first: list[tuple[int, int]]) -> None:
    """A fresh attempt starts at its frame 0: one that first shows up later lost its start (an
    empty or cut answer otherwise, e.g. when the subscription moved to another server)."""
    async with subscribed(own_nats) as (nc, inbox, reply):
        for attempt, seq in first:
            await nc.publish(inbox, delta(seq, f"t{seq}", attempt=attempt))
        for _ in first[:-1]:
            await reply.next(5)
        with pytest.raises(ServingError) as failed:
            await reply.next(5)
        assert failed.value.code == ErrorCode.FRAMES_LOST
        await reply.close()


async def test_a_migrated_stream_reads_the_new_attempt_only(own_nats: NatsServer) -> None:
    async with subscribed(own_nats) as (nc, inbox, reply):
        await nc.publish(inbox, delta(0, "a"))
        assert (await reply.next(5)).text == "a"
        reply.lock()
        reply.migrate(4)
        assert (reply.attempt, reply.base_attempt, reply.locked_attempt) == (4, 4, None)
        # The old attempt speaks on (it was only slow): dropped, and no gap of the new one.
        await nc.publish(inbox, delta(1, "old"))
        await nc.publish(inbox, delta(0, "new", attempt=4))
        await nc.publish(inbox, delta(1, "er", attempt=4))
        assert [(await reply.next(5)).text for _ in range(2)] == ["new", "er"]
        await reply.close()


async def test_a_reader_too_slow_for_the_buffer_cancels_the_request(own_nats: NatsServer) -> None:
    overflowed = asyncio.Event()
    async with subscribed(own_nats, max_frames=8, on_overflow=overflowed.set) as (nc, inbox, reply):
        await nc.publish(inbox, delta(0, "read"))
        assert (await reply.next(5)).text == "read"
        for seq in range(1, 40):  # the reader is not reading now
            await nc.publish(inbox, delta(seq, "x"))
        await asyncio.wait_for(overflowed.wait(), 5)
        with pytest.raises(ServingError) as failed:
            await reply.next(5)
        assert failed.value.code == ErrorCode.CLIENT_TOO_SLOW
        await reply.close()


async def test_failing_a_stream_wakes_its_waiting_reader() -> None:
    """What every open stream gets when the bus connection is lost: the wait ends at once."""
    reply = ReplyStream()
    waiting = asyncio.create_task(reply.next(60))
    await asyncio.sleep(0)
    reply.fail(ServingError(503, ErrorCode.BUS_UNAVAILABLE, "gone"))
    with pytest.raises(ServingError) as failed:
        await asyncio.wait_for(waiting, 5)
    assert failed.value.code == ErrorCode.BUS_UNAVAILABLE


async def test_silence_past_the_allowance_is_a_timeout_and_frames_within_it_are_not() -> None:
    """One timer per stream, not one per frame: a wait that outlives an earlier, shorter wait's
    deadline keeps waiting until its own, and silence to its own deadline ends it."""
    reply = ReplyStream()
    first = asyncio.create_task(reply.next(0.05))  # arms the timer for 50 ms from now
    await asyncio.sleep(0)
    reply.on_frame(delta(0, "a"))
    assert (await first).text == "a"
    second = asyncio.create_task(reply.next(30))
    await asyncio.sleep(0.2)  # the first wait's deadline (and its timer) is long past
    assert not second.done()
    reply.on_frame(delta(1, "b"))
    assert (await second).text == "b"
    with pytest.raises(ReplyTimeout):
        await reply.next(0.05)
    await reply.close()

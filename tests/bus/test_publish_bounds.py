"""Every publish is measured with its headers (issue 35), on a real nats-server with the stock
1 MiB max_payload: every kind of event a client can size, at the payload boundary ± 64 bytes,
is stored (by reference past the limit) and read back whole; a frame, a service reply or a
JetStream message past the limit is refused before it is sent; the connection never closes.
A full EVENTS refuses new events and drops none; refused events are held and stored later.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy

from apps.bus import connection, declaration, event_publish, publish, topology, wire
from apps.bus.codes import Api, ErrorCode, FinishReason, RunStatus
from apps.bus.events import (
    AdmissionDecided,
    AdmissionDecision,
    BenchRunRecorded,
    Event,
    EventRef,
    ResponseDeleted,
    ResponseStored,
    RunFinished,
    RunStarted,
    event_decoder,
)
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.recorder.large_events import resolve
from apps.worker.replies import Replier
from apps.worker.run_record import RunRecord
from engine.frontend.protocol import SamplingParams
from tests.support import eventually_async

OFFSETS = (-64, -1, 0, 1, 64)


@pytest.fixture
def stock_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(tmp_path / "nats", max_payload=None) as server:
        yield server


async def connected(url: str, limits: BusLimits | None = None, closed: list[bool] | None = None) -> NatsClient:
    async def on_closed() -> None:
        if closed is not None:
            closed.append(True)

    nc = await connection.connect(url, "publish-bounds-test", max_reconnect_attempts=0, closed_cb=on_closed)
    await declaration.ensure_topology(nc.jetstream(), limits or BusLimits())
    return nc


def _run_finished(pad: str) -> Event:
    return RunFinished(model="m", node="n", request_id="r", api=Api.CHAT_COMPLETIONS, principal=None,
                            status=RunStatus.ERROR, finish_reason=FinishReason.ERROR, prompt_tokens=1,
                            completion_tokens=0, cached_tokens=0, attempt=1, queue_ms=0.0, ttft_ms=None,
                            prefill_ms=0.0, decode_ms=0.0, e2e_ms=1.0, error=pad)


# Each kind of event whose size a client can influence, padded through a field a client fills.
KINDS: dict[str, Callable[[str], Event]] = {
    "response.stored": lambda pad: ResponseStored(
        model="m", node="gateway", response_id="resp_x", principal=None,
        input_items=[{"type": "reasoning", "encrypted_content": pad}], response={"id": "resp_x", "output": []}),
    "response.deleted": lambda pad: ResponseDeleted(model="m", node="gateway", response_id=pad, principal=None),
    "run.finished": _run_finished,
    "run.started": lambda pad: RunStarted(model="m", node="n", request_id="r", api=Api.RESPONSES,
                                               principal=pad, prompt_tokens=1, attempt=1, queue_ms=0.0),
    "admission": lambda pad: AdmissionDecided(model="m", node="gateway", request_id="r", principal=None,
                                                   decision=AdmissionDecision.ADMITTED, detail=pad,
                                                   pending=0, in_flight=0),
    "bench.run": lambda pad: BenchRunRecorded(model="m", node="bench", run_id="b", target="t",
                                                   scenario="capability:x", started_at=0.0, finished_at=1.0,
                                                   results={"text": pad}),
}


def event_of_wire_size(kind: str, size: int) -> Event:
    """An event whose message (headers with its Nats-Msg-Id, and body) is exactly `size` bytes."""
    make = KINDS[kind]
    base = make("")
    overhead = publish.message_size(wire.encode(base), {"Nats-Msg-Id": base.event_id})
    event = make("x" * (size - overhead))
    event = msgspec.structs.replace(event, event_id=base.event_id, ts=base.ts)
    assert publish.message_size(wire.encode(event), {"Nats-Msg-Id": event.event_id}) == size
    return event


async def read_events(nc: NatsClient, count: int) -> list[tuple[Msg, Event]]:
    """The events of EVENTS from its first, references read back from the Object Store."""
    js = nc.jetstream()
    puller = await topology.replay_puller(nc)
    try:
        msgs = await puller.fetch(count, timeout=10)
        assert len(msgs) == count
        pending = [(msg, event_decoder.decode(msg.data)) for msg in msgs]
        events, buried, later, unavailable = await resolve(js, pending, budget_bytes=64 << 20)
        assert not buried and not later and not unavailable
        return events
    finally:
        await puller.stop()


@pytest.mark.parametrize("kind", sorted(KINDS))
async def test_every_client_sized_event_at_the_boundary_is_stored_whole(stock_server: NatsServer, kind: str) -> None:
    closed: list[bool] = []
    nc = await connected(stock_server.url, closed=closed)
    try:
        limit = nc.max_payload
        assert limit == 1 << 20
        sent = [event_of_wire_size(kind, limit + offset) for offset in OFFSETS]
        for event in sent:
            assert await event_publish.publish_event(nc.jetstream(), event, required=True)
            assert nc.is_connected, f"{kind} at {len(wire.encode(event))} bytes"
        got = await read_events(nc, len(sent))
        assert [event for _, event in got] == sent
        # Within the limit inline (the server counts the headers too), past it by reference.
        by_ref = [isinstance(event_decoder.decode(msg.data), EventRef) for msg, _ in got]
        assert by_ref == [offset > 0 for offset in OFFSETS]
        assert all(len(msg.data) < 1024 for (msg, _), ref in zip(got, by_ref, strict=True) if ref)
        await connection.reached_server(nc)
        assert nc.is_connected and not nc.is_closed and not closed
    finally:
        await nc.close()


async def test_a_jetstream_message_past_the_limit_is_refused_before_sending(stock_server: NatsServer) -> None:
    nc = await connected(stock_server.url)
    try:
        js = nc.jetstream()
        headers = {"Nats-Msg-Id": "window"}
        exact = b"x" * (nc.max_payload - publish.message_size(b"", headers))
        await publish.publish(js, topology.event_subject("x", "y"), exact, "window")
        with pytest.raises(publish.TooLarge) as caught:
            await publish.publish(js, topology.event_subject("x", "y"), exact + b"x", "windox")
        assert caught.value.size == nc.max_payload + 1
        await connection.reached_server(nc)
        assert nc.is_connected
    finally:
        await nc.close()


async def test_a_frame_past_the_limit_becomes_an_error_frame_and_the_connection_stays(
        stock_server: NatsServer) -> None:
    nc = await connected(stock_server.url)
    try:
        frames: list[wire.ReplyFrame] = []
        got = asyncio.Event()

        async def on_frame(msg: Msg) -> None:
            frames.append(wire.frame_decoder.decode(msg.data))
            got.set()

        await nc.subscribe("_INBOX.frames", cb=on_frame)
        replier = Replier(nc, "_INBOX.frames", attempt=1, node="n")
        arguments = "x" * (2 << 20)
        await replier.delta("", 1, tool_calls=[wire.ToolCallDelta(index=0, id="c", name="f", arguments=arguments)])
        await asyncio.wait_for(got.wait(), 10)
        (frame,) = frames
        assert isinstance(frame, wire.ErrorFrame) and frame.code == ErrorCode.GENERATION_FAILED and frame.seq == 0
        assert replier.undeliverable and replier.ended  # the error frame was the attempt's last
        # An error message is bounded whatever the caller passes.
        got.clear()
        replier = Replier(nc, "_INBOX.frames", attempt=2, node="n")
        await replier.error(500, ErrorCode.GENERATION_FAILED, "y" * (4 << 20))
        await asyncio.wait_for(got.wait(), 10)
        assert isinstance(frames[-1], wire.ErrorFrame) and len(frames[-1].message.encode()) <= wire.MAX_TEXT_BYTES
        await connection.reached_server(nc)
        assert nc.is_connected
    finally:
        await nc.close()


async def test_a_service_reply_past_the_limit_is_refused_before_sending(stock_server: NatsServer) -> None:
    nc = await connected(stock_server.url)
    try:
        async def answer(msg: Msg) -> None:
            with pytest.raises(publish.TooLarge):
                await publish.respond(msg, b"x" * (2 << 20))
            await publish.respond(msg, b"small")

        await nc.subscribe("svc.echo", cb=answer)
        assert (await nc.request("svc.echo", b"", timeout=10)).data == b"small"
        assert nc.is_connected
    finally:
        await nc.close()


# An admission event's detail longer than the small fillers `fill_events` leaves room for.
LATE_DETAIL = "refused while full, and longer than the small fillers"


async def fill_events(js: JetStreamContext) -> int:
    """EVENTS (at 64 KiB) filled: large events, then the room they leave with small ones, a
    little smaller than an admission event of `LATE_DETAIL` (more than the few bytes a
    timestamp's length varies by), which then cannot fit. Returns how many were stored."""
    large = [KINDS["admission"](f"filler {i:03} " + "x" * 900) for i in range(200)]
    small = [KINDS["admission"]("small") for _ in range(200)]
    stored = 0
    for events in (large, small):
        for event in events:
            try:
                await publish.publish(js, topology.event_subject("admission", "m"), wire.encode(event),
                                      event.event_id)
                stored += 1
            except publish.StreamFull:
                break
        else:
            pytest.fail("EVENTS took every filler")
    assert stored > 0
    return stored


async def test_a_full_events_stream_refuses_new_events_drops_none_and_the_refused_are_stored_later(
        stock_server: NatsServer) -> None:
    limits = BusLimits(event_max_bytes=64 << 10)
    nc = await connected(stock_server.url, limits)
    try:
        js = nc.jetstream()
        info = await js.stream_info(topology.EVENTS_STREAM)
        assert info.config.discard == DiscardPolicy.NEW
        stored = await fill_events(js)
        full: list[bool] = []
        late = KINDS["admission"](LATE_DETAIL)
        assert not await event_publish.publish_event(js, late, on_full=lambda: full.append(True))
        assert full and event_publish.held_events() == 1
        state = (await js.stream_info(topology.EVENTS_STREAM)).state
        assert (state.first_seq, state.messages) == (1, stored), "nothing already stored was dropped"
        # Room again (what a recorder does once it recorded them): the held event goes in by itself.
        await js.purge_stream(topology.EVENTS_STREAM, seq=stored + 1)
        await eventually_async(lambda: _held_none(), 20.0, message="the held event stored")
        got = await read_events(nc, 1)
        assert [event for _, event in got] == [late]
    finally:
        await nc.close()


async def _held_none() -> bool:
    return event_publish.held_events() == 0


async def test_an_existing_discard_old_events_stream_is_converged_to_discard_new(stock_server: NatsServer) -> None:
    nc = await connection.connect(stock_server.url, "converge", max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        old = dataclasses.replace(topology.events_stream_config(BusLimits()), discard=DiscardPolicy.OLD)
        await js.add_stream(old)
        assert (await js.stream_info(topology.EVENTS_STREAM)).config.discard == DiscardPolicy.OLD
        await declaration.ensure_topology(js, BusLimits())
        assert (await js.stream_info(topology.EVENTS_STREAM)).config.discard == DiscardPolicy.NEW
    finally:
        await nc.close()


def test_error_texts_are_bounded_where_runs_are_recorded() -> None:
    request = wire.GenerateRequest(request_id="r", model="m", reply_subject="_INBOX.x", sampling=SamplingParams())
    record = RunRecord(request, "n", 1, received_at=0.0)
    grammar = "start: " + " | ".join(f'"choice {i} ' + "x" * 500 + '"' for i in range(2001))
    # As llguidance words it: one line of reason, then the parser's state and the grammar.
    state = f"structured output failed: Parser Error: max is 2000\n<state>\nrows: 1\n</state>\n{grammar}"
    event = record.finished_event(RunStatus.ERROR, FinishReason.ERROR, state)
    assert event.error == "structured output failed: Parser Error: max is 2000"
    event = record.finished_event(RunStatus.ERROR, FinishReason.ERROR, f"structured output failed: {grammar}")
    assert event.error is not None and len(event.error.encode()) <= wire.MAX_TEXT_BYTES
    assert event.error.startswith("structured output failed: start: ") and "cut" in event.error
    cut = wire.bounded_text("é" * 2000, 101)
    assert len(cut.encode()) <= 101 and cut.startswith("éé")  # cut on a character boundary
    assert wire.bounded_text("short") == "short"
    # Code that treats a bus error as "unavailable" catches a refused message too.
    assert issubclass(publish.TooLarge, nats.errors.Error)

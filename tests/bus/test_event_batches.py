"""Events published together share EVENTS messages (`apps.bus.event_publish`): one message per
subject, within the count and the server's byte limit, and each publisher hears its event stored."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from apps.bus import connection, declaration, event_publish, topology
from apps.bus.codes import NodeState
from apps.bus.events import EventRef, NodeStatusChanged, decode_events, event_decoder, event_kind
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from tests.bus.test_publish_bounds import KINDS
from tests.support import eventually_async


@pytest.fixture
def server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(tmp_path / "nats", max_payload=None) as server:  # nats-server's own 1 MiB
        yield server


@pytest.fixture
async def nc(server: NatsServer) -> NatsClient:
    nc = await connection.connect(server.url, "event-batches-test", max_reconnect_attempts=0)
    await declaration.ensure_topology(nc.jetstream(), BusLimits())
    yield nc
    await nc.close()


async def _messages(nc: NatsClient) -> list[list]:
    """The events of each EVENTS message, from its first, in order."""
    count = (await nc.jetstream().stream_info(topology.EVENTS_STREAM)).state.messages
    puller = await topology.replay_puller(nc)
    try:
        msgs = await puller.fetch(count, timeout=10)
        assert len(msgs) == count
        return [decode_events(msg.data) for msg in msgs]
    finally:
        await puller.stop()


async def test_events_published_together_share_one_message_per_subject(nc: NatsClient) -> None:
    finished = [KINDS["run.finished"](f"run {i}") for i in range(40)]
    admitted = [KINDS["admission"](f"request {i}") for i in range(10)]
    js = nc.jetstream()
    stored = await asyncio.gather(*(event_publish.publish_event(js, e) for e in [*finished, *admitted]))
    assert all(stored)
    by_kind = {event_kind(m[0]): m for m in await _messages(nc)}
    assert set(by_kind) == {"run.finished", "admission"}  # two messages
    assert by_kind["run.finished"] == finished and by_kind["admission"] == admitted


async def test_a_message_holds_at_most_the_count_and_what_the_server_takes(
        nc: NatsClient, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(event_publish, "BATCH_MAX_EVENTS", 16)
    js = nc.jetstream()
    small = [KINDS["run.finished"](f"run {i}") for i in range(40)]
    assert all(await asyncio.gather(*(event_publish.publish_event(js, e) for e in small)))
    assert [len(m) for m in await _messages(nc)] == [16, 16, 8]
    await js.purge_stream(topology.EVENTS_STREAM)
    # 300 kB each against nats-server's 1 MiB: three to a message; one past the limit alone goes by
    # reference, in a message of its own.
    large = [KINDS["admission"](f"{i}" + "x" * 300_000) for i in range(5)]
    huge = KINDS["admission"]("y" * 1_200_000)
    assert all(await asyncio.gather(*(event_publish.publish_event(js, e) for e in [*large[:3], huge, *large[3:]])))
    messages = await _messages(nc)
    assert [len(m) for m in messages] == [3, 1, 2]
    assert messages[0] == large[:3] and messages[2] == large[3:]
    ref = messages[1][0]
    assert isinstance(ref, EventRef) and ref.event_id == huge.event_id
    stored = await (await js.object_store(topology.LARGE_EVENTS_BUCKET)).get(ref.object)
    assert event_decoder.decode(stored.data or b"") == huge


async def test_kinds_outside_the_per_request_ones_go_one_to_a_message(nc: NatsClient) -> None:
    statuses = [NodeStatusChanged(model="m", node=f"n{i}", status=NodeState.READY, version="1", models=["m"],
                                  slots=1, free_slots=1) for i in range(5)]
    assert all(await asyncio.gather(*(event_publish.publish_event(nc.jetstream(), e) for e in statuses)))
    assert await _messages(nc) == [[e] for e in statuses]


async def test_a_publisher_cancelled_while_its_event_waits_leaves_it_to_go_out(nc: NatsClient) -> None:
    event = KINDS["run.started"]("cancelled caller")
    waiting = asyncio.ensure_future(event_publish.publish_event(nc.jetstream(), event))
    await asyncio.sleep(0)  # the event joins its batch
    waiting.cancel()

    async def stored() -> bool:
        return (await nc.jetstream().stream_info(topology.EVENTS_STREAM)).state.messages == 1

    await eventually_async(stored, 10.0, message="the cancelled caller's event stored")
    assert await _messages(nc) == [[event]]

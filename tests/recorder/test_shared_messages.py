"""EVENTS messages that carry several events (`apps.bus.event_publish` batches): each event is
recorded, a poison among them goes to the dead-letter table alone, and the message is settled
once, after all of its events (`apps.recorder.parts`)."""

from __future__ import annotations

import secrets

import asyncpg
import msgspec
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from apps.bus import events, wire
from apps.bus.codes import NodeState
from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER, event_subject, recorder_puller
from apps.embedded.nats_server import NatsServer
from apps.recorder.app import decode
from apps.settings import RecorderSettings
from tests.recorder.conftest import LogWatch, recording, started, wait_all_acked


async def _publish_batch(js: JetStreamContext, sent: list[events.Event], kind: str | None = None) -> None:
    subject = event_subject(kind or events.event_kind(sent[0]), sent[0].model)
    await js.publish(subject, events.batch_body([wire.encode(e) for e in sent]))


async def test_a_shared_message_records_each_event_and_dead_letters_its_poison_alone(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    good = [started(f"good-{i}") for i in range(3)]
    # Too long for a btree index entry: PostgreSQL refuses its `runs` row (see test_dead_letters).
    poison = started("x" + secrets.token_urlsafe(12_000))
    await _publish_batch(js, [good[0], poison, *good[1:]])
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url, batch_size=64)
    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await wait_all_acked(js)  # settled once every event is: recorded or dead-lettered
    info = await js.stream_info(EVENTS_STREAM)
    assert info.state.messages == 1
    conn = await asyncpg.connect(database_url)
    try:
        runs = {r["request_id"] for r in await conn.fetch("SELECT request_id FROM runs")}
        (letter,) = await conn.fetch("SELECT * FROM dead_letters")
        recorded = await conn.fetchval("SELECT count(*) FROM events WHERE stream_seq = 1")
    finally:
        await conn.close()
    assert runs == {e.request_id for e in good}
    assert recorded == 3
    # The letter keeps the one event that failed, not its neighbours.
    assert letter["event_id"] == poison.event_id and letter["stream_seq"] == 1
    assert msgspec.json.decode(letter["payload"])["request_id"] == poison.request_id
    consumer = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
    assert consumer.delivered.stream_seq == 1 and consumer.num_redelivered == 0


async def test_a_part_nakd_brings_the_whole_message_back_and_acks_settle_it_once(nc: NatsClient) -> None:
    js = nc.jetstream()
    sent = [started(f"r-{i}") for i in range(3)]
    await _publish_batch(js, sent)
    puller = await recorder_puller(nc, ack_wait_s=60.0)
    try:
        (msg,) = await puller.fetch(1, timeout=5)
        pending, buried = decode([msg])
        assert not buried and [e.event_id for _, e in pending] == [e.event_id for e in sent]
        first, second, third = (m for m, _ in pending)
        await first.ack()
        await second.nak()  # e.g. its batch failed while the recorder stopped
        await third.ack()  # ignored: the message is coming back whole
        (again,) = await puller.fetch(1, timeout=5)
        assert again.metadata.num_delivered == 2
        pending, _ = decode([again])
        for m, _ in pending:
            await m.ack()
        # JetStream applies an ack after the flush's round trip may return: wait for it, well inside
        # the 60 s ack wait (an ack never sent would leave the message pending past it).
        await wait_all_acked(js, timeout_s=10)
    finally:
        await puller.stop()


async def test_only_the_per_request_kinds_may_share_a_message(nc: NatsClient) -> None:
    js = nc.jetstream()
    status = events.NodeStatusChanged(model="tiny", node="n", status=NodeState.READY, version="1", models=["tiny"],
                                      slots=1, free_slots=1)
    await _publish_batch(js, [status, status])
    puller = await recorder_puller(nc)
    try:
        (msg,) = await puller.fetch(1, timeout=5)
        pending, buried = decode([msg])
        assert not pending
        (only,) = buried
        assert "one to a message" in only[1].error
    finally:
        await puller.stop()


async def test_an_empty_array_is_undecodable(nc: NatsClient) -> None:
    js = nc.jetstream()
    await js.publish(event_subject("run.started", "tiny"), b"[]")
    puller = await recorder_puller(nc)
    try:
        (msg,) = await puller.fetch(1, timeout=5)
        pending, buried = decode([msg])
        assert not pending and len(buried) == 1
    finally:
        await puller.stop()

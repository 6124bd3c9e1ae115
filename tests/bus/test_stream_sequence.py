"""`stream_sequence` reads a message's stream sequence from its ack subject, as nats-py's metadata does."""

from __future__ import annotations

import pytest
from nats.aio.msg import Msg

from apps.bus.connection import connect
from apps.bus.declaration import ensure_topology
from apps.bus.pull import BatchPuller, stream_sequence
from apps.bus.topology import EVENTS_STREAM, BusLimits, event_subject, replay_puller
from apps.embedded.nats_server import NatsServer


async def test_matches_nats_metadata_on_real_deliveries(own_nats: NatsServer) -> None:
    nc = await connect(own_nats.url, "test")
    try:
        js = nc.jetstream()
        await ensure_topology(js, BusLimits())
        for i in range(5):
            await js.publish(event_subject("bench.score", "m"), f'{{"i": {i}}}'.encode())
        puller: BatchPuller = await replay_puller(nc)
        msgs = await puller.fetch(5, timeout=5)
        assert [stream_sequence(m) for m in msgs] == [m.metadata.sequence.stream for m in msgs] == [1, 2, 3, 4, 5]
        await puller.stop()
        await js.delete_consumer(EVENTS_STREAM, puller.consumer)
    finally:
        await nc.close()


def test_reads_the_domain_form_of_ack_subjects() -> None:
    reply = "$JS.ACK.hub.ACCHASH.EVENTS.recorder.2.981.77.1700000000000000000.12.rnd"
    msg = Msg(_client=None, subject=event_subject("run.started", "m"), reply=reply)  # type: ignore[arg-type]
    assert stream_sequence(msg) == msg.metadata.sequence.stream == 981


def test_refuses_a_subject_that_is_no_ack() -> None:
    with pytest.raises(ValueError, match="not a JetStream ack subject"):
        stream_sequence(Msg(_client=None, subject="x", reply="_INBOX.abc"))  # type: ignore[arg-type]

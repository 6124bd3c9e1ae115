"""A full REQUESTS stream refuses the new request and keeps every request already queued (discard new)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator

import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js.api import DiscardPolicy

from apps.bus import connection, declaration, topology
from apps.bus.publish import StreamFull, is_stream_full, publish
from apps.embedded.nats_server import NatsServer

SUBJECT = topology.request_subject("tiny")


@pytest.fixture
async def nc(own_nats: NatsServer) -> AsyncIterator[NatsClient]:
    nc = await connection.connect(own_nats.url, "stream-full-test")
    try:
        yield nc
    finally:
        await nc.close()


async def _queued(nc: NatsClient) -> list[bytes]:
    js = nc.jetstream()
    state = (await js.stream_info(topology.REQUESTS_STREAM)).state
    return [(await js.get_msg(topology.REQUESTS_STREAM, seq)).data or b""
            for seq in range(state.first_seq, state.last_seq + 1)] if state.messages else []


async def test_a_full_stream_refuses_the_new_request_and_keeps_the_queued_ones(nc: NatsClient) -> None:
    js = nc.jetstream()
    await declaration.ensure_topology(js, topology.BusLimits(request_max_msgs=3))
    queued = [f"request {i} of another user".encode() for i in range(3)]
    for i, body in enumerate(queued):
        await publish(js, SUBJECT, body, f"req-{i}")

    started = time.monotonic()
    with pytest.raises(StreamFull) as refused:
        await publish(js, SUBJECT, b"one too many", "req-3", within_s=30)
    # Refused at once: a full stream is an answer, not a hiccup to retry for `within_s`.
    assert time.monotonic() - started < 15
    assert is_stream_full(refused.value)
    assert isinstance(refused.value, nats.errors.Error)  # still caught by "the bus failed" handlers
    assert "maximum messages exceeded" in refused.value.description
    assert await _queued(nc) == queued

    # A worker taking one request (work queue: acked means removed) makes room for exactly one more.
    await js.add_consumer(topology.REQUESTS_STREAM, config=topology.worker_consumer_config("tiny"))
    sub = await js.pull_subscribe_bind(durable=topology.worker_consumer("tiny"), stream=topology.REQUESTS_STREAM)
    (first,) = await sub.fetch(1, timeout=5)
    assert first.data == queued[0]
    await first.ack_sync()
    await publish(js, SUBJECT, b"fits now", "req-4")
    with pytest.raises(StreamFull):
        await publish(js, SUBJECT, b"full again", "req-5")
    assert await _queued(nc) == [*queued[1:], b"fits now"]


async def test_the_byte_limit_refuses_too(nc: NatsClient) -> None:
    js = nc.jetstream()
    await declaration.ensure_topology(js, topology.BusLimits(request_max_bytes=4096))
    await publish(js, SUBJECT, b"x" * 1000, "small")
    with pytest.raises(StreamFull) as refused:
        await publish(js, SUBJECT, b"y" * 8000, "large")
    assert "maximum bytes exceeded" in refused.value.description
    assert await _queued(nc) == [b"x" * 1000]


async def test_a_stream_declared_with_discard_old_converges_on_discard_new(nc: NatsClient) -> None:
    js = nc.jetstream()
    limits = topology.BusLimits()
    await js.delete_stream(topology.REQUESTS_STREAM)  # as declared by a version from before discard-new
    await js.add_stream(dataclasses.replace(topology.requests_stream_config(limits), discard=DiscardPolicy.OLD))
    await declaration.ensure_topology(js, limits)
    assert (await js.stream_info(topology.REQUESTS_STREAM)).config.discard == DiscardPolicy.NEW


def test_other_errors_are_not_a_full_stream() -> None:
    assert not is_stream_full(TimeoutError())
    assert not is_stream_full(nats.errors.NoRespondersError())
    assert not is_stream_full(nats.js.errors.APIError(code=503, err_code=10008, description="jetstream not enabled"))
    assert is_stream_full(nats.js.errors.APIError(code=503, err_code=10077, description="maximum messages exceeded"))

"""Objects written from and read into chunk streams (`apps.bus.object_streams`, under /v1/files)
are the Object Store's own format: nats-py reads what they write and the other way round, and a
put whose content fails leaves no chunk behind."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js.object_store import OBJ_STREAM_TEMPLATE

from apps.bus import declaration, topology
from apps.bus.event_publish import _publish_event_once
from apps.bus.events import ResponseStored, event_kind
from apps.bus.object_streams import CHUNK_BYTES, put_stream, read_stream
from apps.bus.topology import BusLimits, event_subject
from apps.embedded.nats_server import NatsServer

BUCKET = topology.FILES_BUCKET


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start:start + size]


async def test_a_streamed_object_is_an_ordinary_object(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        store = await js.object_store(BUCKET)
        data = os.urandom(3 * CHUNK_BYTES + 12345)
        info = await put_stream(js, BUCKET, "streamed", pieces(data, 7000))
        assert (info.size, info.chunks) == (len(data), 4)
        assert (await store.get("streamed")).data == data  # nats-py reads it, digest checked
        await store.put("by-nats-py", data)
        read = b"".join([chunk async for chunk in read_stream(js, await store.get_info("by-nats-py"))])
        assert read == data
        empty = await put_stream(js, BUCKET, "empty", pieces(b"", 1))
        assert [chunk async for chunk in read_stream(js, empty)] == []
        for name in ("streamed", "by-nats-py", "empty"):
            await store.delete(name)
    finally:
        await nc.close()


async def test_a_failed_put_leaves_no_chunks(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    try:
        js = nc.jetstream()
        stream = OBJ_STREAM_TEMPLATE.format(bucket=BUCKET)
        before = (await js.stream_info(stream)).state.messages

        async def failing() -> AsyncIterator[bytes]:
            yield os.urandom(2 * CHUNK_BYTES)
            raise ValueError("the client went away")

        with pytest.raises(ValueError):
            await put_stream(js, BUCKET, "half", failing())
        assert (await js.stream_info(stream)).state.messages == before
    finally:
        await nc.close()


async def test_a_server_taking_less_than_a_chunk_gets_chunks_it_takes(tmp_path: Path) -> None:
    """A server configured below nats-py's 128 KiB chunk (64 KiB here): streamed objects, and
    events too large for one message, go in chunks of what it takes, not a refused publish."""
    with NatsServer(tmp_path / "nats", max_payload=64 << 10) as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream()
            await declaration.ensure_topology(js, BusLimits())
            data = os.urandom(3 * CHUNK_BYTES)
            info = await put_stream(js, BUCKET, "small-server", pieces(data, 7000))
            assert info.chunks == len(data) // (64 << 10)
            assert (await (await js.object_store(BUCKET)).get("small-server")).data == data
            event = ResponseStored(model="m", node="gateway", response_id="resp_x", principal=None,
                                   response={"output": "x" * (200 << 10)})
            await _publish_event_once(js, event_subject(event_kind(event), "m"), event)
            stored = await (await js.object_store(topology.LARGE_EVENTS_BUCKET)).get(event.event_id)
            assert msgspec.json.decode(stored.data)["response"] == event.response
        finally:
            await nc.close()

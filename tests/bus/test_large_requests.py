"""Requests of any size travel (issue 14): through the Object Store when one message cannot carry
them, measured with their headers against the connected server's max_payload, so the window
where nats-py's body-only check passes and the server's fails never closes a connection.

On real nats-servers: one started with nats-server's default max_payload (1 MiB) and the embedded
configuration (8 MiB); the worker side runs the real `WorkerProcess` with the scripted engine.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Awaitable, Iterator
from pathlib import Path

import msgspec
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js.errors import ObjectNotFoundError

from apps.bus import connection, declaration, large_requests, topology, wire
from apps.bus.publish import StreamFull
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import EMBEDDED_MAX_PAYLOAD, NatsServer
from apps.settings import WorkerSettings
from apps.worker.model_loop import ModelLoop
from apps.worker.process import WorkerProcess
from engine.frontend.model_source import load_tokenizer
from engine.frontend.protocol import SamplingParams, ServiceClass
from engine.frontend.scripted import ScriptedEngine
from engine.loading.default_model import default_model_path
from tests.support import declared, eventually_async

MODEL = "large-model"
DEFAULT_MAX_PAYLOAD = 1 << 20  # nats-server's own


# A server configured to take less than an Object Store chunk (nats-py's 128 KiB) in one message.
TINY_MAX_PAYLOAD = 64 << 10


@pytest.fixture(params=["default-1MiB", "embedded-8MiB", "tiny-64KiB"])
def server(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[NatsServer]:
    max_payload = {"default-1MiB": None, "embedded-8MiB": EMBEDDED_MAX_PAYLOAD}.get(request.param, TINY_MAX_PAYLOAD)
    with NatsServer(tmp_path / "nats", max_payload=max_payload) as server:
        declared(server)
        yield server


@pytest.fixture
def small_server(tmp_path: Path) -> Iterator[NatsServer]:
    with NatsServer(tmp_path / "nats", max_payload=None) as server:
        declared(server)
        yield server


async def connected(url: str) -> NatsClient:
    nc = await connection.connect(url, "large-requests-test", max_reconnect_attempts=0)
    await declaration.ensure_topology(nc.jetstream(), BusLimits())
    return nc


def request_of_size(size: int, request_id: str = "big-1", reply_subject: str = "_INBOX.big") -> wire.GenerateRequest:
    """A request whose encoded body is exactly `size` bytes."""
    def make(prompt: str) -> wire.GenerateRequest:
        return wire.GenerateRequest(request_id=request_id, model=MODEL, reply_subject=reply_subject,
                                    sampling=SamplingParams(max_tokens=8), prompt=prompt, created_at=1.0)
    base = len(wire.encode(make("")))
    request = make("x" * (size - base))
    assert len(wire.encode(request)) == size
    return request


async def take_one(nc: NatsClient) -> Msg:
    """The next REQUESTS message of MODEL, as a worker's pull would get it."""
    puller = await topology.worker_puller(nc, MODEL, BusLimits())
    try:
        (msg,) = await puller.fetch(1, timeout=10)
        return msg
    finally:
        await puller.stop()


async def object_exists(nc: NatsClient, name: str) -> bool:
    store = await nc.jetstream().object_store(topology.LARGE_REQUESTS_BUCKET)
    try:
        await store.get_info(name)
    except ObjectNotFoundError:
        return False
    return True


async def test_the_embedded_server_takes_8_mib_messages(server: NatsServer) -> None:
    nc = await connected(server.url)
    try:
        assert nc.max_payload == (server.max_payload or DEFAULT_MAX_PAYLOAD)
    finally:
        await nc.close()


async def test_a_3_mib_request_travels_and_leaves_nothing_behind(server: NatsServer) -> None:
    nc = await connected(server.url)
    try:
        js = nc.jetstream()
        request = request_of_size(3 << 20)
        await large_requests.publish_request(js, nc, request)
        msg = await take_one(nc)
        body = wire.decode_request(msg.data)
        if server.max_payload != EMBEDDED_MAX_PAYLOAD:
            # Over the server's limit: the message is a small reference to an object (in chunks
            # the server takes, however small its limit).
            assert isinstance(body, wire.RequestRef) and len(msg.data) < 1024
            assert body.size == len(wire.encode(request)) and await object_exists(nc, body.object)
            assert await large_requests.fetch(js, body) == request
            await msg.ack()
            await large_requests.delete(js, body)
            assert not await object_exists(nc, body.object)
            with pytest.raises(large_requests.RequestGone):
                await large_requests.fetch(js, body)
            await large_requests.delete(js, body)  # twice is fine
        else:
            assert body == request  # 3 MiB is one message on the embedded server
            await msg.ack()
        info = await js.stream_info(f"OBJ_{topology.LARGE_REQUESTS_BUCKET}")
        assert info.state.bytes < 4096  # no chunk left, only the deletion marker at most
        assert info.config.max_age == BusLimits().request_max_age_s  # objects go with their messages
    finally:
        await nc.close()


async def test_a_large_batch_line_queues_on_its_class_subject(small_server: NatsServer) -> None:
    """A batch-class request, too large for its message, goes where its class's consumer pulls it
    (as a reference to its object), never onto the model's interactive subject."""
    nc = await connected(small_server.url)
    try:
        js = nc.jetstream()
        await js.add_consumer(topology.REQUESTS_STREAM, config=topology.worker_consumer_config(MODEL))
        request = msgspec.structs.replace(request_of_size(3 << 20, "big-batch"), service_class=ServiceClass.BATCH)
        ack = await large_requests.publish_request(js, nc, request)
        stored = await js.get_msg(topology.REQUESTS_STREAM, ack.seq)
        assert stored.subject == topology.request_subject(MODEL, ServiceClass.BATCH) != topology.request_subject(MODEL)
        puller = await topology.worker_puller(nc, MODEL, BusLimits(), ServiceClass.BATCH)
        try:
            (msg,) = await puller.fetch(1, timeout=10)
        finally:
            await puller.stop()
        ref = wire.decode_request(msg.data)
        assert isinstance(ref, wire.RequestRef) and await large_requests.fetch(js, ref) == request
        await msg.ack()
        await large_requests.delete(js, ref)
        interactive = await js.consumer_info(topology.REQUESTS_STREAM, topology.worker_consumer(MODEL))
        assert interactive.num_pending == 0 and not interactive.delivered.stream_seq
    finally:
        await nc.close()


async def test_sizes_around_the_header_window_never_close_the_connection(small_server: NatsServer) -> None:
    """A body under max_payload whose headers push the message over it closed the connection for
    good; every size from well under the limit to over it now arrives, whole."""
    nc = await connected(small_server.url)
    try:
        js = nc.jetstream()
        limit = nc.max_payload
        header_bytes = large_requests.message_size(b"", {"Nats-Msg-Id": "fuzz-000"})
        low, high = limit - header_bytes - 16, limit + 16
        rng = random.Random(14)
        sizes = sorted({low, high, limit, limit - 1, limit - header_bytes, limit - header_bytes + 1,
                        *rng.sample(range(low, high + 1), 24)})
        for i, size in enumerate(sizes):
            request = request_of_size(size, request_id=f"fuzz-{i:03d}")
            await large_requests.publish_request(js, nc, request)
            assert nc.is_connected, f"size {size}"
            msg = await take_one(nc)
            body = wire.decode_request(msg.data)
            if isinstance(body, wire.RequestRef):
                assert await large_requests.fetch(js, body) == request, f"size {size}"
                await large_requests.delete(js, body)
            else:
                assert body == request, f"size {size}"
            await msg.ack()
        await connection.reached_server(nc)
        assert nc.is_connected and not nc.is_closed
    finally:
        await nc.close()


async def test_without_the_check_a_message_in_the_window_closes_the_connection(small_server: NatsServer) -> None:
    """Why the check counts headers: nats-py lets this body through and the server hangs up."""
    nc = await connected(small_server.url)
    closed = asyncio.Event()
    try:
        body = b"x" * (nc.max_payload - 8)
        headers = {"Nats-Msg-Id": "window-1"}
        assert not large_requests.fits(nc, body, headers)
        raw = await nats.connect(small_server.url, max_reconnect_attempts=0, closed_cb=_set(closed),
                                 error_cb=_ignore)
        await raw.publish(topology.request_subject(MODEL), body, headers=headers)
        await asyncio.wait_for(closed.wait(), 10)
        assert raw.is_closed
    finally:
        await nc.close()


def _set(event: asyncio.Event):  # type: ignore[no-untyped-def]
    async def callback() -> None:
        event.set()
    return callback


async def _ignore(exc: Exception) -> None:
    pass


async def _not(check: Awaitable[bool]) -> bool:
    return not await check


async def test_a_publish_the_stream_refuses_leaves_no_object(small_server: NatsServer) -> None:
    nc = await connected(small_server.url)
    try:
        js = nc.jetstream()
        await declaration.ensure_topology(js, BusLimits(request_max_msgs=1))
        await large_requests.publish_request(js, nc, request_of_size(1000, request_id="first"))
        with pytest.raises(nats.errors.Error):
            await large_requests.publish_request(js, nc, request_of_size(2 << 20, request_id="refused"))
        assert not await object_exists(nc, "refused")
    finally:
        await nc.close()


async def test_a_worker_serves_a_3_mib_prompt_through_a_1_mib_server_and_deletes_its_object(
        small_server: NatsServer, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(default_model_path())[0]
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": "read it all"}), encoding="utf-8")
    settings = WorkerSettings(nats_url=small_server.url, node_id="large", heartbeat_s=0.5, status_interval_s=0.5)
    # A window wide enough for the whole prompt: this test is about the bus, not the context.
    engine = ScriptedEngine(script, tokenizer, MODEL, max_model_len=4_000_000)
    loop = ModelLoop(settings, engine, tokenizer, MODEL)
    loop.context.prefill_tok_per_s = 1e6  # as if measured on a fast machine: no throughput ceiling
    process = WorkerProcess(settings, BusLimits())
    stop = asyncio.Event()
    running = asyncio.create_task(process.run(stop, loop))
    await asyncio.wait({running, asyncio.create_task(process.ready.wait())}, return_when=asyncio.FIRST_COMPLETED)
    nc = await connected(small_server.url)
    try:
        frames: list[wire.ReplyFrame] = []
        ended = asyncio.Event()

        async def on_frame(msg: Msg) -> None:
            frames.append(wire.frame_decoder.decode(msg.data))
            if isinstance(frames[-1], (wire.Final, wire.ErrorFrame)):
                ended.set()

        await nc.subscribe("_INBOX.big", cb=on_frame)
        sentence = "The quick brown fox jumps over the lazy dog. "
        request = msgspec.structs.replace(request_of_size(1000), prompt=sentence * ((3 << 20) // len(sentence)))
        assert len(wire.encode(request)) > 3 << 20
        await large_requests.publish_request(nc.jetstream(), nc, request)
        await asyncio.wait_for(ended.wait(), 300)
        # Heartbeats may come first: the worker's loop goes on while the prompt is tokenized.
        accepted, final = next(f for f in frames if not isinstance(f, wire.Heartbeat)), frames[-1]
        assert isinstance(accepted, wire.Accepted) and accepted.prompt_tokens > 500_000
        assert isinstance(final, wire.Final), final
        assert "".join(f.text for f in frames if isinstance(f, wire.Delta)) == "read it all"
        # Deleted once the message is settled, right after the answer.
        await eventually_async(lambda: _not(object_exists(nc, request.request_id)), 20.0, message="the object deleted")
    finally:
        await nc.close()
        stop.set()
        await running


async def test_a_full_bucket_is_a_full_queue(small_server: NatsServer) -> None:
    nc = await connected(small_server.url)
    try:
        js = nc.jetstream()
        await declaration.ensure_topology(js, BusLimits(request_max_bytes=3 << 20))
        await large_requests.publish_request(js, nc, request_of_size(2 << 20, request_id="fits"))
        with pytest.raises(StreamFull):
            await large_requests.publish_request(js, nc, request_of_size(2 << 20, request_id="over"))
    finally:
        await nc.close()

"""`BatchPuller` on a real server: an idle consumer costs one pull request per wait, a message
that arrives while it waits is handed out at once, and nothing ever waits a wait out: stopping
ends it (and the server drops its pull, so the next message goes to whoever pulls next), and so
does a reconnect to a restarted server, which forgot the pull."""

from __future__ import annotations

import asyncio

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from apps.bus.connection import connect, reached_server
from apps.bus.declaration import ensure_topology
from apps.bus.pull import BatchPuller
from apps.bus.topology import EVENTS_STREAM, BusLimits, event_subject, replay_puller, request_subject, worker_puller
from apps.embedded.nats_server import NatsServer


async def test_an_idle_consumer_costs_one_pull_per_wait(own_nats: NatsServer) -> None:
    nc = await connect(own_nats.url, "test")
    watcher = await connect(own_nats.url, "watcher")
    try:
        js = nc.jetstream()
        await ensure_topology(js, BusLimits())
        puller: BatchPuller = await replay_puller(nc)
        pulls: list[bytes] = []

        async def count(msg: Msg) -> None:
            pulls.append(msg.data)

        sub = await watcher.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{EVENTS_STREAM}.{puller.consumer}", cb=count)
        await reached_server(watcher)
        assert await puller.fetch(8, timeout=0.2) == []
        assert len(pulls) == 2  # "anything there?" (no_wait), then the pull that waits
        for _ in range(3):
            assert await puller.fetch(8, timeout=0.2) == []
        await reached_server(watcher)
        assert len(pulls) == 5  # then only the pull that waits, once per fetch
        assert all(b"expires" in pull for pull in pulls[1:])

        waiting = asyncio.create_task(puller.fetch(8, timeout=30))
        while len(pulls) < 6:  # the wait's pull has reached the server
            await asyncio.sleep(0.01)
        await js.publish(event_subject("bench.score", "m"), b'{"i": 1}')
        msgs = await waiting
        assert [m.data for m in msgs] == [b'{"i": 1}']
        await sub.unsubscribe()
        await puller.stop()
        await js.delete_consumer(EVENTS_STREAM, puller.consumer)
    finally:
        await watcher.close()
        await nc.close()


async def test_stopping_ends_a_wait_and_the_server_drops_its_pull(own_nats: NatsServer) -> None:
    nc = await connect(own_nats.url, "test")
    try:
        js = nc.jetstream()
        limits = BusLimits()
        first = await worker_puller(nc, "m", limits)
        waiting = asyncio.create_task(first.fetch(1, timeout=600))
        await reached_server(nc)  # its pull waits at the server
        assert await first.stop() == []
        # A wait of ten minutes, ended by the stop (the bound only keeps a broken stop from hanging).
        assert await asyncio.wait_for(waiting, 30) == []
        # The stopped puller's pull is still within its ten minutes, but its inbox is gone: the
        # server hands the request to the next puller instead of to nobody.
        await js.publish(request_subject("m"), b"request")
        second = await worker_puller(nc, "m", limits)
        (msg,) = await second.fetch(1, timeout=30)
        assert msg.data == b"request" and msg.metadata.num_delivered == 1
        await msg.ack()
        await second.stop()
    finally:
        await nc.close()


async def test_a_reconnect_ends_a_wait_the_restarted_server_forgot(own_nats: NatsServer) -> None:
    nc = await connect(own_nats.url, "test")
    try:
        puller = await worker_puller(nc, "m", BusLimits())
        waiting = asyncio.create_task(puller.fetch(1, timeout=600))
        await reached_server(nc)
        # Killed, not stopped: a server that shuts down ends its pulls (409) itself.
        own_nats.process.kill()  # type: ignore[union-attr]
        own_nats.process.wait()  # type: ignore[union-attr]
        own_nats.start()
        # Back on the restarted server, the wait ends instead of running out its ten minutes.
        assert await asyncio.wait_for(waiting, 60) == []
        await published_once_up(nc, request_subject("m"), b"after the restart")
        (msg,) = await puller.fetch(1, timeout=30)
        assert msg.data == b"after the restart"
        await msg.ack()
        await puller.stop()
    finally:
        await nc.close()


async def published_once_up(nc: NatsClient, subject: str, data: bytes) -> None:
    """Published as soon as JetStream answers again (a restarted server recovers its streams
    after it takes connections; nothing announces when)."""
    for _ in range(300):
        try:
            await nc.jetstream().publish(subject, data)
            return
        except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
            await asyncio.sleep(0.1)
    raise AssertionError("JetStream never came back")

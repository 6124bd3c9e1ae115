"""`BatchPuller` on a real server: an idle consumer costs one pull request per wait, and a message
that arrives while it waits is handed out at once."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from apps.bus.connection import connect, reached_server
from apps.bus.declaration import ensure_topology
from apps.bus.pull import BatchPuller
from apps.bus.topology import EVENTS_STREAM, BusLimits, event_subject, replay_puller
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

"""The gateway's node registry (apps/gateway/node_registry.py) against a real NATS server: the
entries written before it started are all read before it answers, whenever they arrive; later
writes and deletes show at once; and it watches without waking the gateway when nothing changes
(no flow control, no heartbeats)."""

from __future__ import annotations

import asyncio
import time

import pytest
from nats.js import JetStreamContext

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.connection import connect
from apps.bus.topology import NODES_BUCKET, BusLimits, node_registry
from apps.embedded.nats_server import NatsServer
from apps.gateway import node_registry as node_registry_module
from apps.gateway.bus_client import GatewayBus
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import NodeRegistry
from tests.support import eventually_async


def status(node: str, model: str) -> bytes:
    return wire.encode(wire.NodeStatus(node=node, version="test",
                                       models=[wire.ModelStatus(model=model, slots=4, free_slots=4)]))


async def test_entries_written_before_it_started_are_read_before_it_answers(
        own_nats: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    writer = await connect(own_nats.url, "writer")
    bus = await GatewayBus.connect(own_nats.url, BusLimits(), GatewayMetrics())
    registry = NodeRegistry(bus, BusLimits())
    try:
        nodes = await node_registry(writer.jetstream(), BusLimits())
        await nodes.put("early", status("early", "m"))
        # The watch's first look at its consumer comes only once the server has delivered the
        # entry (what a loaded machine does): nothing is pending any more, but it is not read yet.
        consumer_info = JetStreamContext.PushSubscription.consumer_info

        async def late_consumer_info(sub: JetStreamContext.PushSubscription):  # type: ignore[no-untyped-def]
            while not sub._pending_queue.qsize():
                await asyncio.sleep(0.01)
            return await consumer_info(sub)

        monkeypatch.setattr(JetStreamContext.PushSubscription, "consumer_info", late_consumer_info)
        registry.start()
        assert [n.node for n in await asyncio.wait_for(registry.serving("m"), 30)] == ["early"]

        await nodes.put("later", status("later", "m"))
        await eventually_async(lambda: _serving(registry, "m", ["early", "later"]), 30)
        await nodes.delete("early")
        await eventually_async(lambda: _serving(registry, "m", ["later"]), 30)
        # Watched through a plain push consumer: no flow control nor heartbeats to answer.
        (info,) = await writer.jetstream().consumers_info(f"KV_{NODES_BUCKET}")
        assert not info.config.flow_control and not info.config.idle_heartbeat
    finally:
        await registry.stop()
        await bus.close()
        await writer.close()


async def _serving(registry: NodeRegistry, model: str, nodes: list[str]) -> bool:
    return sorted(n.node for n in await registry.serving(model)) == nodes


async def test_an_entry_its_worker_left_to_expire_is_forgotten_and_a_new_write_brings_it_back(
        own_nats: NatsServer) -> None:
    """Expiry sends no marker, so an entry whose worker died would stay in the gateway for good
    (one per node id ever seen); past a few TTLs it is forgotten. A write of it later counts again."""
    writer = await connect(own_nats.url, "writer")
    limits = BusLimits()
    bus = await GatewayBus.connect(own_nats.url, limits, GatewayMetrics())
    registry = NodeRegistry(bus, limits)
    try:
        nodes = await node_registry(writer.jetstream(), limits)
        dead = wire.NodeStatus(node="dead", version="test", models=[wire.ModelStatus(model="m", slots=4, free_slots=4)],
                               updated_at=time.time() - 10 * limits.node_ttl_s)
        await nodes.put("dead", wire.encode(dead))
        await nodes.put("alive", status("alive", "m"))
        registry.start()
        assert [n.node for n in await asyncio.wait_for(registry.serving("m"), 30)] == ["alive"]
        assert "dead" not in registry.remembered()
        await nodes.put("dead", status("dead", "m"))
        await eventually_async(lambda: _serving(registry, "m", ["alive", "dead"]), 30)
    finally:
        await registry.stop()
        await bus.close()
        await writer.close()


async def test_a_registry_never_read_is_a_503_naming_the_bus_not_a_wait_without_end(
        own_nats: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its watch failing since the gateway started (a bucket it may not read, say), the registry
    has no reading: requests, /ready and /metrics get a 503 after READY_WAIT_S instead of hanging."""
    monkeypatch.setattr(node_registry_module, "READY_WAIT_S", 0.5)
    bus = await GatewayBus.connect(own_nats.url, BusLimits(), GatewayMetrics())
    registry = NodeRegistry(bus, BusLimits())  # its watch never started
    try:
        with pytest.raises(ServingError) as refused:
            await asyncio.wait_for(registry.live_nodes(), 30)
        assert (refused.value.status, refused.value.code) == (503, ErrorCode.BUS_UNAVAILABLE)
    finally:
        await bus.close()

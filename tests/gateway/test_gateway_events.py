"""The gateway's background event publisher: events reach EVENTS without the request waiting,
and a full queue drops (and counts) instead of blocking."""

from __future__ import annotations

from apps.bus import topology
from apps.bus.events import AdmissionDecided, AdmissionDecision, decode_events
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.gateway.bus_client import GatewayBus
from apps.gateway.events import EventPublisher
from apps.gateway.metrics import GatewayMetrics
from tests.support import eventually_async


def decided(i: int) -> AdmissionDecided:
    return AdmissionDecided(model="m", node="gateway", request_id=f"r{i}", principal=None,
                                 decision=AdmissionDecision.ADMITTED, pending=1, in_flight=1)


def sample(metrics: GatewayMetrics, name: str) -> float:
    value = metrics.registry.get_sample_value(name)
    assert value is not None, name
    return value


async def test_events_are_published_in_the_background(own_nats: NatsServer) -> None:
    metrics = GatewayMetrics()
    bus = await GatewayBus.connect(own_nats.url, BusLimits(), metrics)
    events = EventPublisher(bus, metrics)
    events.start()
    try:
        for i in range(20):
            events.emit(decided(i))  # returns at once: nothing here awaits the bus

        async def stored() -> bool:  # events published together share messages: count the events
            state = (await bus.js.stream_info(topology.EVENTS_STREAM)).state
            if not state.messages:
                return False
            seqs = range(state.first_seq, state.last_seq + 1)
            return sum([len(decode_events((await bus.js.get_msg(topology.EVENTS_STREAM, seq)).data or b""))
                        for seq in seqs]) == 20

        await eventually_async(stored, 10)
        assert events.backlog == 0 and sample(metrics, "helexa:gateway_event_backlog") == 0
    finally:
        await events.stop()
        await bus.close()


async def test_a_full_queue_drops_and_counts(own_nats: NatsServer) -> None:
    metrics = GatewayMetrics()
    bus = await GatewayBus.connect(own_nats.url, BusLimits(), metrics)
    events = EventPublisher(bus, metrics, max_backlog=3)  # not started: nothing drains the queue
    try:
        for i in range(10):
            events.emit(decided(i))
        assert events.backlog == 3
        assert sample(metrics, "helexa:gateway_event_backlog") == 3
        assert sample(metrics, "helexa:gateway_events_dropped_total") == 7
    finally:
        await bus.close()

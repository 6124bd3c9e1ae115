"""The gateway loses no text from a worker that starts its reply without an `Accepted` frame:
a bare NATS client stands in for the worker (the bus speaks plain JSON, so any client may serve)."""

from __future__ import annotations

import asyncio
import time

import nats

from apps.bus import topology, wire
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.gateway.admission import AdmissionLimits, Admissions
from apps.gateway.bus_client import GatewayBus
from apps.gateway.cold_start import ColdStarts
from apps.gateway.events import EventPublisher
from apps.gateway.generation import GenerationPipeline
from apps.gateway.liveness import Canceller
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import NodeRegistry
from apps.settings import GatewaySettings
from engine.protocol import SamplingParams


async def test_a_reply_without_accepted_keeps_its_first_delta(own_nats: NatsServer) -> None:
    metrics = GatewayMetrics()
    bus = await GatewayBus.connect(own_nats.url, BusLimits(), metrics)
    cold_starts = ColdStarts(bus, NodeRegistry(bus, BusLimits()), metrics)
    events = EventPublisher(bus, metrics)
    admissions = Admissions(AdmissionLimits(), None, metrics, events.emit)
    pipeline = GenerationPipeline(bus, cold_starts, admissions, Canceller(lambda: bus.nc), events, metrics,
                                  GatewaySettings())
    worker = await nats.connect(own_nats.url)
    # Pulled from REQUESTS as a real worker does (a plain core subscription to the request subject
    # missed the message now and then on a loaded machine, though the stream had stored it).
    pulled = await worker.jetstream().pull_subscribe(topology.request_subject("bare"), durable="bare-worker",
                                                    stream=topology.REQUESTS_STREAM)

    async def serve() -> None:
        msg = (await pulled.fetch(batch=1, timeout=30))[0]
        await msg.ack()
        request = wire.request_decoder.decode(msg.data)
        usage = wire.Usage(prompt_tokens=3, completion_tokens=2)
        for frame in (wire.Delta(seq=0, text="Hello", num_tokens=1),
                      wire.Delta(seq=1, text=" there", num_tokens=1, finish_reason="stop"),
                      wire.Final(seq=2, finish_reason="stop", usage=usage)):
            await worker.publish(request.reply_subject, wire.encode(frame))

    serving = asyncio.create_task(serve())
    try:
        request = wire.GenerateRequest(request_id="bare-1", model="bare", reply_subject=bus.new_inbox(),
                                       sampling=SamplingParams(), prompt="hi", deadline=time.time() + 30)
        generation = await pipeline.first_frame(request, "test")
        texts = [f.text async for f in pipeline.frames(generation) if isinstance(f, wire.Delta)]
        assert "".join(texts) == "Hello there"
        await pipeline.close(generation)
        await serving
    finally:
        serving.cancel()
        await worker.close()
        await bus.close()

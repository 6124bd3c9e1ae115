"""The gateway loses no text from a worker that starts its reply without an `Accepted` frame, and
tells the worker of requests it is still reading: a bare NATS client stands in for the worker (the
bus speaks plain JSON, so any client may serve)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

import msgspec
import nats
from litestar import Request
from litestar.testing import RequestFactory
from nats.js import JetStreamContext

from apps.bus import topology, wire
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.gateway.admission import AdmissionLimits, Admissions
from apps.gateway.api.completions import CompletionFormatter
from apps.gateway.api.openai_schema import CompletionRequest
from apps.gateway.body_reading import BodyReader
from apps.gateway.bus_client import GatewayBus
from apps.gateway.cold_start import ColdStarts
from apps.gateway.events import EventPublisher
from apps.gateway.generation import GenerationPipeline
from apps.gateway.liveness import Canceller
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import NodeRegistry
from apps.settings import GatewaySettings
from engine.frontend.protocol import SamplingParams


def pipeline_on(bus: GatewayBus, metrics: GatewayMetrics, registry: NodeRegistry | None = None,
                settings: GatewaySettings | None = None) -> GenerationPipeline:
    cold_starts = ColdStarts(bus, registry or NodeRegistry(bus, BusLimits()), metrics)
    events = EventPublisher(bus, metrics)
    admissions = Admissions(AdmissionLimits(), None, metrics, events.emit)
    return GenerationPipeline(bus, cold_starts, admissions, Canceller(lambda: bus.nc), events, metrics,
                              settings or GatewaySettings())


async def bare_worker(url: str, model: str) -> tuple[nats.NATS, JetStreamContext.PullSubscription]:
    """A plain NATS client pulling `model`'s requests from REQUESTS as a real worker does (a core
    subscription to the request subject missed the message now and then on a loaded machine)."""
    worker = await nats.connect(url)
    pulled = await worker.jetstream().pull_subscribe(topology.request_subject(model), durable=f"{model}-worker",
                                                    stream=topology.REQUESTS_STREAM)
    return worker, pulled


async def next_request(pulled: JetStreamContext.PullSubscription) -> wire.GenerateRequest:
    msg = (await pulled.fetch(batch=1, timeout=30))[0]
    await msg.ack()
    return wire.request_decoder.decode(msg.data)


def whole_answer(attempt: int = 1) -> list[wire.ReplyFrame]:
    usage = wire.Usage(prompt_tokens=3, completion_tokens=2)
    return [wire.Delta(seq=0, attempt=attempt, text="Hello", num_tokens=1),
            wire.Delta(seq=1, attempt=attempt, text=" there", num_tokens=1, finish_reason="stop"),
            wire.Final(seq=2, attempt=attempt, finish_reason="stop", usage=usage)]


def new_request(bus: GatewayBus, request_id: str, model: str) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, model=model, reply_subject=bus.new_reply_subject(),
                                sampling=SamplingParams(), prompt="hi", deadline=time.time() + 30)


async def frames_read(url: str, model: str,
                      serve: Callable[[nats.NATS, JetStreamContext.PullSubscription], Awaitable[None]],
                      settings: GatewaySettings | None = None) -> list[wire.Delta | wire.Final]:
    """The frames a gateway's pipeline reads of one request for `model`, while `serve` plays its
    worker on a bare NATS client (it must have served by the time the answer ends)."""
    metrics = GatewayMetrics()
    bus = await GatewayBus.connect(url, BusLimits(), metrics)
    pipeline = pipeline_on(bus, metrics, settings=settings)
    worker, pulled = await bare_worker(url, model)
    serving = asyncio.create_task(serve(worker, pulled))
    try:
        generation = await pipeline.first_frames.wait(new_request(bus, f"{model}-1", model), "test")
        frames = [f async for f in pipeline.frames(generation)]
        await pipeline.close(generation)
        await serving
        return frames
    finally:
        serving.cancel()
        await worker.close()
        await bus.close()


async def test_a_reply_without_accepted_keeps_its_first_delta(own_nats: NatsServer) -> None:
    async def serve(worker: nats.NATS, pulled: JetStreamContext.PullSubscription) -> None:
        request = await next_request(pulled)
        for frame in whole_answer():
            await worker.publish(request.reply_subject, wire.encode(frame))

    frames = await frames_read(own_nats.url, "bare", serve)
    texts = [f.text for f in frames if isinstance(f, wire.Delta)]
    assert "".join(texts) == "Hello there"


async def test_an_answer_whose_start_was_lost_goes_on_as_a_new_attempt(own_nats: NatsServer) -> None:
    """Only the end of the first attempt arrives (its first frames went nowhere, as when the
    gateway's subscription moves to another server of a cluster): never an empty or cut answer,
    the request is published again and the next attempt's answer is the one read, whole."""
    attempts: list[int] = []

    async def serve(worker: nats.NATS, pulled: JetStreamContext.PullSubscription) -> None:
        request = await next_request(pulled)
        attempts.append(request.attempt)
        await worker.publish(request.reply_subject, wire.encode(whole_answer()[-1]))
        request = await next_request(pulled)
        attempts.append(request.attempt)
        for frame in whole_answer(attempt=request.attempt):
            await worker.publish(request.reply_subject, wire.encode(frame))

    frames = await frames_read(own_nats.url, "lossy", serve)
    assert "".join(f.text for f in frames if isinstance(f, wire.Delta)) == "Hello there"
    assert isinstance(frames[-1], wire.Final)
    assert attempts == [1, 1 + BusLimits().max_deliver]


async def test_a_delta_without_text_pins_its_attempt_so_a_migration_resumes_one_answer(own_nats: NatsServer) -> None:
    """The first delta holds a token and no text yet (held back: a tag, half a character, a stop
    string's start), and the client has it (its logprobs, its count). Then a redelivery's attempt
    starts from scratch beside it: its frames are not this client's answer. When the stream then
    goes silent, the migration resumes from the tokens of the one attempt the client read, never
    the two mixed."""
    resumed: list[list[int]] = []

    async def serve(worker: nats.NATS, pulled: JetStreamContext.PullSubscription) -> None:
        request = await next_request(pulled)
        await worker.publish(request.reply_subject, wire.encode(
            wire.Delta(seq=0, attempt=1, text="", num_tokens=1, token_ids=[5])))
        # A second delivery of the same message, answering from its start, then lost too.
        await worker.publish(request.reply_subject, wire.encode(
            wire.Delta(seq=0, attempt=2, text="Other", num_tokens=1, token_ids=[9])))
        migrated = await next_request(pulled)
        resumed.extend(choice.token_ids for choice in migrated.resume or [])
        usage = wire.Usage(prompt_tokens=3, completion_tokens=3)
        for frame in [wire.Delta(seq=0, attempt=migrated.attempt, text="Hello", num_tokens=1, token_ids=[7]),
                      wire.Delta(seq=1, attempt=migrated.attempt, text=" there", num_tokens=1, token_ids=[8],
                                 finish_reason="stop"),
                      wire.Final(seq=2, attempt=migrated.attempt, finish_reason="stop", usage=usage)]:
            await worker.publish(migrated.reply_subject, wire.encode(frame))

    frames = await frames_read(own_nats.url, "pinned", serve, GatewaySettings(stream_idle_timeout_s=1.0))
    deltas = [f for f in frames if isinstance(f, wire.Delta)]
    assert [t for d in deltas for t in d.token_ids] == [5, 7, 8]
    assert "".join(d.text for d in deltas) == "Hello there"
    assert resumed == [[5]]


async def answer(worker: nats.NATS, request: wire.GenerateRequest) -> None:
    for frame in whole_answer():
        await worker.publish(request.reply_subject, wire.encode(frame))


class LateBody:
    """A POST whose headers are in and whose body comes once `send()` is called; then it stays
    connected."""

    def __init__(self, body: bytes) -> None:
        self.body, self.reading, self.sent = body, asyncio.Event(), asyncio.Event()
        self.connected = asyncio.Event()  # never set: the client does not hang up
        scope = RequestFactory().post("/v1/completions", headers={"Content-Type": "application/json"}).scope
        self.request = Request({**scope, "state": {}}, receive=self.receive)
        self._delivered = False

    async def receive(self) -> dict[str, object]:
        if self._delivered:
            await self.connected.wait()
        self.reading.set()
        await self.sent.wait()
        self._delivered = True
        return {"type": "http.request", "body": self.body, "more_body": False}

    def send(self) -> None:
        self.sent.set()


async def test_a_request_read_while_another_is_still_read_announces_it(own_nats: NatsServer) -> None:
    """Two requests begun together (headers in), bodies in one after the other: the first body in
    tells its worker that another is arriving, the last that none is."""
    metrics = GatewayMetrics()
    bus = await GatewayBus.connect(own_nats.url, BusLimits(), metrics)
    worker, pulled = await bare_worker(own_nats.url, "burst")
    # The bare worker's node entry, there before the registry's first read: the pipeline routes to it.
    nodes = await topology.node_registry(worker.jetstream(), BusLimits())
    await nodes.put("bare-node", wire.encode(wire.NodeStatus(
        node="bare-node", version="test", models=[wire.ModelStatus(model="burst", slots=4, free_slots=4)])))
    registry = NodeRegistry(bus, BusLimits())
    registry.start()
    pipeline = pipeline_on(bus, metrics, registry)
    body = msgspec.json.encode({"model": "burst", "prompt": "hi", "max_tokens": 2})
    first_in, last_in = LateBody(body), LateBody(body)
    bodies = BodyReader()
    reads = [asyncio.create_task(bodies.read(c.request, CompletionRequest)) for c in (first_in, last_in)]
    try:
        await first_in.reading.wait()
        await last_in.reading.wait()
        first_in.send()
        await reads[0]
        last_in.send()
        await reads[1]
        for client, request_id, arriving in ((first_in, "burst-1", 1), (last_in, "burst-2", 0)):
            request = new_request(bus, request_id, "burst")
            serving = asyncio.create_task(pipeline.serve(client.request, request, CompletionFormatter(request, False),
                                                         "test"))
            published = await next_request(pulled)
            assert (published.request_id, published.arriving) == (request_id, arriving)
            await answer(worker, published)
            assert msgspec.json.decode((await serving).content)["choices"][0]["text"] == "Hello there"
    finally:
        first_in.send()
        last_in.send()
        await asyncio.gather(*reads, return_exceptions=True)
        await registry.stop()
        await worker.close()
        await bus.close()

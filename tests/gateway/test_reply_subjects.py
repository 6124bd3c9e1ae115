"""Frames reach a request's stream only from a worker that was delivered the request: its reply
subject ends in 128 random bits that only such a worker learns (workers may not read gateways'
inboxes), and a migrated request moves to a new subject, so the worker that lost it cannot take
the stream back with the new attempt's number. Gateway and workers here use their roles' users."""

from __future__ import annotations

import time

import nats.errors
from nats.aio.client import Client as NatsClient

from apps.bus import connection, roles, topology, wire
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsServer
from apps.gateway.bus_client import GatewayBus
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.migration import Delivered, migrated
from engine.frontend.protocol import SamplingParams

MODEL = "subjects-model"
LIMITS = BusLimits()
USAGE = wire.Usage(prompt_tokens=1, completion_tokens=2)


def answer(attempt: int, text: str, token: int) -> list[wire.ReplyFrame]:
    return [wire.Accepted(seq=0, attempt=attempt, node="n", prompt_tokens=1),
            wire.Delta(seq=1, attempt=attempt, text=text, num_tokens=1, token_ids=[token], finish_reason="stop"),
            wire.Final(seq=2, attempt=attempt, finish_reason="stop", usage=USAGE)]


async def send(nc: NatsClient, subject: str, frames: list[wire.ReplyFrame]) -> None:
    for frame in frames:
        await nc.publish(subject, wire.encode(frame))
    await connection.reached_server(nc)


async def worker(server: NatsServer, name: str) -> NatsClient:
    return await connection.connect(server.url_for(roles.WORKER), name, role=roles.WORKER, max_reconnect_attempts=0)


async def take(nc: NatsClient) -> wire.GenerateRequest:
    """The next request of MODEL through its consumer, acked at once."""
    pulled = await topology.worker_puller(nc, MODEL, LIMITS)
    (msg,) = await pulled.fetch(1, timeout=10)
    await msg.ack()
    return wire.request_decoder.decode(msg.data)


async def read_all(stream, count: int) -> list[wire.ReplyFrame]:  # type: ignore[no-untyped-def]
    return [await stream.next(10) for _ in range(count)]


def new_request(bus: GatewayBus, request_id: str) -> wire.GenerateRequest:
    return wire.GenerateRequest(request_id=request_id, model=MODEL, reply_subject=bus.new_reply_subject(),
                                sampling=SamplingParams(), prompt="hi", deadline=time.time() + 30)


_DIGITS = "0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def predicted_inbox(first: str, second: str) -> str:
    """The inbox a gateway makes after `second`, from two it made before it, as anyone who saw
    them can work it out: nats-py's inboxes are a fixed prefix and a counter with a fixed step."""
    prefix = topology.inbox_prefix(roles.GATEWAY, "gateway")
    ids = [subject.removeprefix(prefix + ".").split(".")[0] for subject in (first, second)]
    seqs = [sum(_DIGITS.index(c) * 62 ** i for i, c in enumerate(reversed(nuid[12:]))) for nuid in ids]
    seq = 2 * seqs[1] - seqs[0]
    digits = "".join(_DIGITS[seq // 62 ** i % 62] for i in reversed(range(10)))
    return f"{prefix}.{ids[1][:12]}{digits}"


async def test_a_worker_that_served_a_gateways_requests_cannot_reach_the_next_ones_stream(
        own_nats: NatsServer) -> None:
    """The rogue served two requests of the gateway, so it knows their reply subjects and can
    work out the inbox of the next; the next one's 128 random bits it cannot."""
    bus = await GatewayBus.connect(own_nats.url_for(roles.GATEWAY), LIMITS, GatewayMetrics())
    serving, rogue = await worker(own_nats, "serving"), await worker(own_nats, "rogue")
    try:
        requests = [new_request(bus, f"subjects-{i}") for i in range(3)]
        known = []
        for request in requests[:2]:
            stream = await bus.submit(request)
            taken = await take(rogue)
            known.append(taken.reply_subject)
            await send(rogue, taken.reply_subject, answer(1, "served", 5))
            await read_all(stream, 3)
            await stream.close()
        inbox = predicted_inbox(*known)
        target = requests[2].reply_subject
        assert target.split(".")[:4] == inbox.split("."), "the inbox is no secret: the prediction must hit it"
        stream = await bus.submit(requests[2])
        for subject in (inbox, *(f"{inbox}.{k.rsplit('.', 1)[1]}" for k in known)):
            await send(rogue, subject, answer(2, "FORGED", 7))
        taken = await take(serving)
        assert taken.reply_subject == target
        await send(serving, target, answer(1, "real", 8))
        frames = await read_all(stream, 3)
        assert [f.attempt for f in frames] == [1, 1, 1]
        assert [f.text for f in frames if isinstance(f, wire.Delta)] == ["real"]
        await stream.close()
    finally:
        for nc in (serving, rogue):
            await nc.close()
        await bus.close()


async def test_the_worker_that_lost_a_migrated_request_cannot_take_it_back(own_nats: NatsServer) -> None:
    bus = await GatewayBus.connect(own_nats.url_for(roles.GATEWAY), LIMITS, GatewayMetrics())
    lost, serving = await worker(own_nats, "lost"), await worker(own_nats, "serving")
    try:
        request = new_request(bus, "subjects-2")
        stream = await bus.submit(request)
        first = await take(lost)
        await send(lost, first.reply_subject, answer(1, "Hel", 1)[:2])
        accepted, delta = await read_all(stream, 2)
        assert isinstance(delta, wire.Delta) and delta.text == "Hel"
        stream.lock()  # the client has text from attempt 1
        delivered = Delivered(1)
        delivered.add(delta)
        # The worker went silent: the gateway migrates the request from what its client has.
        moved = await bus.resubmit(stream, migrated(request, delivered, LIMITS.max_deliver))
        assert moved.attempt == 1 + LIMITS.max_deliver and moved.reply_subject != request.reply_subject
        # The lost worker comes back and claims the new attempt on the subject it knows.
        await send(lost, first.reply_subject, answer(moved.attempt, "FORGED", 7))
        second = await take(serving)
        assert second.reply_subject == moved.reply_subject and second.resume is not None
        await send(serving, second.reply_subject, answer(moved.attempt, "lo", 2))
        frames = await read_all(stream, 3)
        assert [f.attempt for f in frames] == [moved.attempt] * 3
        assert [f.text for f in frames if isinstance(f, wire.Delta)] == ["lo"]
        # Its alive probes on the old subject are still answered: that attempt was taken.
        probe = await lost.request(topology.alive_subject(first.reply_subject), b"1", timeout=5)
        assert probe.data == topology.ATTEMPT_TAKEN
        await stream.close()
    finally:
        for nc in (lost, serving):
            try:
                await nc.close()
            except nats.errors.Error:
                pass
        await bus.close()

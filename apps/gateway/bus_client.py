"""The gateway's NATS connection, and putting a request on the bus: listen, then publish.

A request's reply subject is this connection's home (under its inbox) plus 128 random bits
(`new_reply_subject`): only a worker delivered the request learns it, and workers may not subscribe
to gateways' inboxes (`apps.bus.roles`), so frames for it come from the worker that took the
request, and no other can take the stream over with a later attempt number. A migrated request
gets a new one. Frames of every request arrive through the connection's one `ReplyRouter`
subscription, alone or in a worker's bundle (`apps.bus.bundles`).

`submit` returns the request's `ReplyStream`; a max-deliveries advisory (JetStream gave up on a
request) is turned into an error frame on that stream, so its client is answered at once.

The connection is watched. nats-py rides out a server restart by itself, but gives up for good
when a server answers with an `-ERR` (e.g. a control line past 4096 bytes): then every open
reply stream fails with `bus_unavailable`, `/health` reports the outage, and a new connection
(with its own subscriptions; the node registry's watch restarts on it) replaces the old one.
Everyone else reads `nc` and `js` here at the moment they use them, so they follow the swap.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from apps.bus import connection, declaration, large_requests, roles, topology, wire
from apps.bus.codes import ErrorCode, ServingError, Unavailable, unavailable
from apps.bus.publish import publish_core
from apps.bus.topology import BusLimits
from apps.gateway.liveness import answer_probes
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.reply_router import ReplyRouter
from apps.gateway.reply_stream import DEFAULT_MAX_FRAMES, ReplyStream

log = logging.getLogger("helexa.gateway")

# How long a health check waits for the server's answer to a ping.
HEALTH_PING_S = 2.0


class GatewayBus:
    def __init__(self, url: str, limits: BusLimits, metrics: GatewayMetrics) -> None:
        self.url = url
        self.limits = limits
        self._metrics = metrics
        self.nc: NatsClient = NatsClient()
        self.js: JetStreamContext = self.nc.jetstream()
        self.router = ReplyRouter(self.nc)
        # Which connection is current: a closed callback of an older one changes nothing.
        self._generation = 0
        self._replacing: asyncio.Task[None] | None = None
        self._closing = False
        self._streams: set[ReplyStream] = set()
        # Stream sequence of each request message this gateway waits on -> the request, so a
        # max-deliveries advisory (which names only the sequence) reaches the right client.
        self._waiting: dict[int, wire.GenerateRequest] = {}
        # The newest message published for each open reply stream (its stream sequence).
        self._message_of: dict[ReplyStream, int] = {}

    @classmethod
    async def connect(cls, url: str, limits: BusLimits, metrics: GatewayMetrics) -> GatewayBus:
        bus = cls(url, limits, metrics)
        await bus._open()
        return bus

    async def _open(self) -> None:
        generation = self._generation + 1

        async def closed() -> None:
            await self._on_closed(generation)

        nc = await connection.connect(self.url, name="helexa-gateway", role=roles.GATEWAY, closed_cb=closed)
        try:
            await declaration.require_topology(nc.jetstream())
            await nc.subscribe(topology.max_deliveries_advisories(), cb=self._on_max_deliveries)
            router = ReplyRouter(nc)
            await router.start()
        except BaseException:
            await nc.close()
            raise
        self.nc, self.js, self.router, self._generation = nc, nc.jetstream(), router, generation

    async def _on_closed(self, generation: int) -> None:
        if self._closing or generation != self._generation:
            return
        log.error("the NATS server closed the connection for good; opening a new one",
                  extra={"error": repr(self.nc.last_error)})
        self._metrics.bus_connections_lost.inc()
        lost = unavailable(Unavailable.BUS_LOST)
        for stream in list(self._streams):
            stream.fail(lost)
        self._waiting.clear()
        self._message_of.clear()
        if self._replacing is None or self._replacing.done():
            self._replacing = asyncio.create_task(self._replace())

    async def _replace(self) -> None:
        # A first pause: a server that just refused us is not asked again in a tight loop.
        pause = 0.5
        while not self._closing:
            await asyncio.sleep(pause)
            try:
                await self._open()
            except (nats.errors.Error, OSError, TimeoutError) as exc:
                log.warning("no new NATS connection yet", extra={"error": repr(exc)})
                pause = min(pause * 2, 5.0)
                continue
            log.info("NATS connection replaced")
            return

    @property
    def open_streams(self) -> int:
        """Answers this gateway is waiting on or relaying now."""
        return len(self._streams)

    def fail_streams(self, error: ServingError) -> None:
        """End every answer in flight with `error` (the gateway is stopping)."""
        for stream in list(self._streams):
            stream.fail(error)

    async def close(self) -> None:
        self._closing = True
        if self._replacing is not None:
            self._replacing.cancel()
        if not self.nc.is_closed:
            await self.nc.drain()

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    async def is_healthy(self) -> bool:
        """Connected, and the server answers a ping (a hung server is an outage too)."""
        if not self.nc.is_connected:
            return False
        try:
            await self.nc.flush(timeout=HEALTH_PING_S)  # type: ignore[arg-type]  # a float works: wait_for
        except (nats.errors.Error, TimeoutError):
            return False
        return True

    async def submit(self, request: wire.GenerateRequest, max_frames: int = DEFAULT_MAX_FRAMES,
                     on_overflow: Callable[[], None] | None = None) -> ReplyStream:
        """Listen on the reply subject first, then publish, so no frame can be missed. While this
        process lives it answers the worker's liveness probes; when it dies, nobody does.
        Raises what `large_requests.publish_request` raises (`StreamFull` among them)."""
        nc, router = self.nc, self.router
        if not router.owns(request.reply_subject):
            # Made for a connection replaced since: frames come only to the current one's home.
            request = msgspec.structs.replace(request, reply_subject=router.new_reply_subject())
        stream = ReplyStream(max_frames, on_overflow)
        router.follow(stream, request.reply_subject)
        self._streams.add(stream)

        def forget() -> None:
            self._streams.discard(stream)
            router.forget(stream)

        stream.on_close = forget
        try:
            stream.subscriptions.append(await answer_probes(nc, stream, request.reply_subject))
            request = msgspec.structs.replace(request, liveness_probe=True)
            await self._publish(stream, request, request.request_id)
        except BaseException:
            await stream.close()
            raise
        return stream

    async def resubmit(self, stream: ReplyStream, request: wire.GenerateRequest) -> wire.GenerateRequest:
        """Publish a migrated attempt of a request whose `stream` is open (a new message, with its
        own dedupe id) on a new reply subject, and return it as published: frames of the attempts
        before `request.attempt` are dropped from now, and the worker that lost the request, which
        knows only the old subject, cannot reach the stream any more (its alive probes there are
        still answered: that attempt was taken)."""
        stream.migrate(request.attempt)
        request = msgspec.structs.replace(request, reply_subject=self.new_reply_subject())
        self.router.follow(stream, request.reply_subject)
        stream.subscriptions.append(await answer_probes(self.nc, stream, request.reply_subject))
        previous = self._message_of.get(stream)
        await self._publish(stream, request, f"{request.request_id}.{request.attempt}")
        if previous is not None:
            # Nobody is to serve the old message again (a redelivery would only be refused).
            try:
                await self.js.delete_msg(topology.REQUESTS_STREAM, previous)
            except (nats.errors.Error, TimeoutError) as exc:
                log.info("the migrated request's old message stays until refused", extra={"error": repr(exc)})
        return request

    async def _publish(self, stream: ReplyStream, request: wire.GenerateRequest, msg_id: str) -> None:
        ack = await large_requests.publish_request(self.js, self.nc, request, msg_id)
        # Advisories are watched for the newest message only: an older one lost the request.
        self._waiting.pop(self._message_of.get(stream, -1), None)
        self._waiting[ack.seq] = request
        self._message_of[stream] = ack.seq

        router = self.router

        def forget() -> None:
            self._streams.discard(stream)
            router.forget(stream)
            self._waiting.pop(ack.seq, None)
            self._message_of.pop(stream, None)

        stream.on_close = forget

    async def _on_max_deliveries(self, msg: Msg) -> None:
        """JetStream gave up on a request (every delivery's worker died holding it): tell its client
        now instead of letting it wait out a deadline, and drop the message from the stream."""
        try:
            advisory = json.loads(msg.data)
            seq = int(advisory["stream_seq"])
        except (ValueError, KeyError, TypeError):
            return
        request = self._waiting.pop(seq, None)
        if request is None:
            return  # another gateway's request, or one of ours that went on as a newer message
        deliveries = int(advisory.get("deliveries") or self.limits.max_deliver)
        # Numbered as the attempt after the message's last one: no worker speaks for it.
        frame = wire.ErrorFrame(
            seq=0, attempt=request.attempt + deliveries, status=500, code=ErrorCode.DELIVERY_FAILED,
            message=f"The request was tried {deliveries} times and every worker serving it stopped; "
                    "it will not be tried again.",
        )
        await publish_core(self.nc, request.reply_subject, wire.encode(frame))
        try:
            await self.js.delete_msg(topology.REQUESTS_STREAM, seq)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("could not drop an undeliverable request", extra={"seq": seq, "error": str(exc)})

    def new_reply_subject(self) -> str:
        """A reply subject for one request: the home of this connection (under the inbox only this
        gateway's NATS user may subscribe to) and 128 random bits nobody can guess."""
        return self.router.new_reply_subject()

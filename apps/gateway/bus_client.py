"""The gateway's NATS connection, and putting a request on the bus: listen, then publish.

`submit` returns the request's `ReplyStream`; a max-deliveries advisory (JetStream gave up on a
request) is turned into an error frame on that stream, so its client is answered at once.
"""

from __future__ import annotations

import json
import logging

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from apps.bus import topology, wire
from apps.bus.codes import ErrorCode
from apps.bus.publish import publish, publish_event
from apps.bus.topology import BusLimits
from apps.gateway.liveness import answer_probes
from apps.gateway.reply_stream import ReplyStream

log = logging.getLogger("helexa.gateway")


class GatewayBus:
    def __init__(self, nc: NatsClient, limits: BusLimits) -> None:
        self.nc = nc
        self.js: JetStreamContext = nc.jetstream()
        self.limits = limits
        # Stream sequence of each request this gateway waits on -> its reply subject, so a
        # max-deliveries advisory (which names only the sequence) reaches the right client.
        self._waiting: dict[int, str] = {}

    @classmethod
    async def connect(cls, url: str, limits: BusLimits) -> GatewayBus:
        nc = await topology.connect(url, name="helexa-gateway")
        await topology.ensure_topology(nc.jetstream(), limits)
        bus = cls(nc, limits)
        await nc.subscribe(topology.max_deliveries_advisories(), cb=bus._on_max_deliveries)
        return bus

    async def close(self) -> None:
        await self.nc.drain()

    @property
    def is_connected(self) -> bool:
        return self.nc.is_connected

    async def submit(self, request: wire.GenerateRequest) -> ReplyStream:
        """Listen on the reply subject first, then publish, so no frame can be missed. While this
        process lives it answers the worker's liveness probes; when it dies, nobody does."""
        sub = await self.nc.subscribe(request.reply_subject)
        stream = ReplyStream(sub)
        stream.alive = await answer_probes(self.nc, stream, request.reply_subject)
        request = msgspec.structs.replace(request, liveness_probe=True)
        try:
            ack = await publish(self.js, topology.request_subject(request.model), wire.encode(request),
                                request.request_id)
        except BaseException:
            await stream.close()
            raise
        self._waiting[ack.seq] = request.reply_subject
        stream.on_close = lambda: self._waiting.pop(ack.seq, None)
        return stream

    async def _on_max_deliveries(self, msg: Msg) -> None:
        """JetStream gave up on a request (every delivery's worker died holding it): tell its client
        now instead of letting it wait out a deadline, and drop the message from the stream."""
        try:
            advisory = json.loads(msg.data)
            seq = int(advisory["stream_seq"])
        except (ValueError, KeyError, TypeError):
            return
        reply_subject = self._waiting.pop(seq, None)
        if reply_subject is None:
            return  # another gateway's request
        deliveries = int(advisory.get("deliveries") or self.limits.max_deliver)
        frame = wire.ErrorFrame(
            seq=0, attempt=deliveries + 1, status=500, code=ErrorCode.DELIVERY_FAILED,
            message=f"The request was tried {deliveries} times and every worker serving it stopped; "
                    "it will not be tried again.",
        )
        await self.nc.publish(reply_subject, wire.encode(frame))
        try:
            await self.js.delete_msg(topology.REQUESTS_STREAM, seq)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("could not drop an undeliverable request", extra={"seq": seq, "error": str(exc)})

    async def publish_event(self, event: wire.AnyEvent) -> None:
        await publish_event(self.js, event)

    def new_inbox(self) -> str:
        return self.nc.new_inbox()

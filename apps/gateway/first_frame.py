"""Publishing an admitted request and waiting for its worker's first frame (runs in the gateway
process): the one step of a generation before which every failure is still a real HTTP status.

`FirstFrames.wait` returns the `Generation` the rest of the lifecycle (`apps.gateway.generation`)
reads frames from; a refusal, a full queue, a bus that cannot take the publish or no worker before
the deadline is a `ServingError` (a 503 with its reason, or the worker's own status).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import nats.errors

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError, Unavailable, unavailable
from apps.bus.publish import StreamFull
from apps.gateway.admission import Ticket
from apps.gateway.bus_client import GatewayBus
from apps.gateway.generation_metrics import GenerationMetrics
from apps.gateway.liveness import Canceller
from apps.gateway.migration import LOST, Migrator
from apps.gateway.reply_stream import ReplyStream, ReplyTimeout
from apps.settings import GatewaySettings


@dataclass(slots=True, weakref_slot=True)
class Generation:
    """A published request the worker has answered: its reply stream and how far it got."""

    request: wire.GenerateRequest
    reply: ReplyStream
    accepted: wire.Accepted
    handler: str
    # A first frame that was not `Accepted` (a worker that skipped it): read before the stream.
    held: wire.ReplyFrame | None = None
    ticket: Ticket | None = None
    finished: bool = False

    @property
    def node(self) -> str:
        return self.accepted.node


def _stand_in_accepted(reply: ReplyStream) -> wire.Accepted:
    """What a generation records as accepted when no `Accepted` frame was read first."""
    return wire.Accepted(seq=0, node=reply.node or "unknown", prompt_tokens=0)


class FirstFrames:
    def __init__(self, bus: GatewayBus, canceller: Canceller, metrics: GenerationMetrics, migrator: Migrator,
                 settings: GatewaySettings) -> None:
        self._bus = bus
        self._canceller = canceller
        self._metrics = metrics
        self._migrator = migrator
        self._settings = settings

    async def wait(self, request: wire.GenerateRequest, handler: str) -> Generation:
        """Publish an addressed request and wait until a worker answers it (or refuses it)."""
        ctx = {"model": request.model, "request_id": request.request_id}

        def overflow() -> None:
            self._metrics.slow_reader(request.model)
            self._canceller.cancel_soon(request.request_id)

        try:
            reply = await self._bus.submit(request, self._settings.stream_buffer_frames, overflow)
        except StreamFull as exc:
            # REQUESTS refuses new messages when full (it never drops queued ones to make room).
            self._metrics.rejected(request.model, ErrorCode.QUEUE_FULL)
            raise unavailable(Unavailable.QUEUE_FULL, {**ctx, "detail": str(exc)}) from None
        except (nats.errors.Error, TimeoutError) as exc:
            # E.g. a NATS server of the cluster died and its streams are electing new leaders.
            self._metrics.rejected(request.model, "bus_unavailable")
            raise unavailable(Unavailable.BUS_UNAVAILABLE, {**ctx, "detail": f"publish failed: {exc!r}"}) from None
        try:
            frame = await reply.next(max(request.deadline - time.time(), 0.001))
        except ServingError as exc:
            if exc.code != ErrorCode.FRAMES_LOST or self._settings.max_migrations == 0:
                self._canceller.cancel_soon(request.request_id)
                await reply.close()
                raise
            # The start of the answer was lost on the way (e.g. while the subscription moved to
            # another server): it goes on as a new attempt, as any answer with lost frames does.
            frame = wire.ErrorFrame(seq=0, attempt=reply.attempt, status=exc.status, code=exc.code,
                                    message=exc.message)
            return Generation(request=request, reply=reply, handler=handler, held=frame,
                              accepted=_stand_in_accepted(reply))
        except ReplyTimeout:
            self._canceller.cancel_soon(request.request_id)
            self._metrics.rejected(request.model, "timeout")
            await reply.close()
            raise unavailable(Unavailable.QUEUE_TIMEOUT,
                              {**ctx, "detail": "no worker accepted before the deadline"}) from None
        except BaseException:
            self._canceller.cancel_soon(request.request_id)
            await reply.close()
            raise
        self._metrics.first_frame(request)
        if isinstance(frame, wire.ErrorFrame):
            self._metrics.errored(request.model, frame.status)
            if frame.code in LOST:
                self._migrator.record_lost_run(request, reply.node or "unknown", frame.attempt - 1, frame.code)
            if frame.code == ErrorCode.CONTEXT_LENGTH_EXCEEDED:
                self._metrics.rejected(request.model, frame.code)
            await reply.close()
            raise ServingError(frame.status, frame.code, frame.message, context={**ctx, "node": reply.node})
        accepted = frame if isinstance(frame, wire.Accepted) else _stand_in_accepted(reply)
        return Generation(request=request, reply=reply, accepted=accepted, handler=handler,
                          held=None if frame is accepted else frame)

"""From a validated API request to a running generation: route, publish, wait for acceptance.

The HTTP status is committed only after the first frame, so errors before the first token are
real statuses even for `stream: true`. Endpoint modules format what `Generation.frames` yields.
"""

from __future__ import annotations

import asyncio
import time
import uuid
import weakref
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
import nats.errors
from litestar import Request

from apps.bus import wire
from apps.bus.codes import ErrorCode, FinishReason, ModelState, RunStatus, ServingError
from apps.fleet.control_client import ControlFailed
from apps.gateway.admission import Rejected, Ticket
from apps.gateway.bus_client import GatewayBus, ReplyStream, ReplyTimeout
from apps.gateway.errors import log_failure, retry_after_s
from apps.settings import GatewaySettings


def _serving(nodes: list[wire.NodeStatus], model: str, state: ModelState | None = None) -> list[wire.NodeStatus]:
    return [n for n in nodes if any(m.model == model and (state is None or m.state == state) for m in n.models)]


async def resolve_model(bus: GatewayBus, model: str) -> list[wire.NodeStatus]:
    """The live nodes serving `model`. A model poisoned everywhere is a 503 at once; a catalogued
    model no worker has loaded is loaded now (cold start); 404 if no worker ever served it, 503
    if none does now."""
    live = await bus.live_nodes()
    nodes = _serving(live, model, ModelState.READY)
    if nodes:
        return nodes
    if _serving(live, model):
        bus.metrics.rejections.labels(model, "poisoned").inc()
        raise ServingError(
            503,
            ErrorCode.MODEL_POISONED,
            f"The model '{model}' is out of service after a device fault on every worker serving it; "
            f"it answers again once reloaded (helexa models load {model}).",
            retry_after_s=retry_after_s(),
            context={"model": model, "detail": "poisoned"},
        )
    if model in bus.catalogue:
        return await _cold_start(bus, model)
    if await bus.model_is_known(model):
        bus.metrics.rejections.labels(model, "no_worker").inc()
        raise ServingError(
            503,
            ErrorCode.MODEL_UNAVAILABLE,
            f"No worker is serving the model '{model}' right now; retry later.",
            retry_after_s=retry_after_s(),
            context={"model": model, "detail": "no live node"},
        )
    raise ServingError(
        404,
        ErrorCode.MODEL_NOT_FOUND,
        f"The model '{model}' does not exist.",
        param="model",
        context={"model": model},
    )


async def _cold_start(bus: GatewayBus, model: str) -> list[wire.NodeStatus]:
    """Have a capable worker load a catalogued model and wait for it, up to the cold-start bound."""
    deadline = time.monotonic() + bus.cold_start_wait_s
    try:
        # Shielded: a client giving up must not abort a load other requests share.
        await asyncio.wait_for(asyncio.shield(bus.load_once(model)), bus.cold_start_wait_s)
        return await bus.wait_for_model(model, max(deadline - time.monotonic(), 0.001))
    except TimeoutError:
        bus.metrics.rejections.labels(model, "loading").inc()
        raise ServingError(
            503,
            ErrorCode.MODEL_LOADING,
            f"The model '{model}' is being loaded; retry shortly.",
            retry_after_s=retry_after_s(),
            context={"model": model, "detail": "cold start outlasted its wait"},
        ) from None
    except ControlFailed as exc:
        bus.metrics.rejections.labels(model, "no_worker").inc()
        raise ServingError(
            503,
            ErrorCode.MODEL_UNAVAILABLE,
            f"The model '{model}' could not be loaded: {exc}",
            retry_after_s=retry_after_s(),
            context={"model": model, "detail": "cold start failed"},
        ) from None


async def record_failed_run(bus: GatewayBus, request: wire.GenerateRequest, node: str, attempt: int, error: str,
                            prompt_tokens: int = 0, completion_tokens: int = 0) -> None:
    """The ledger's RunFinished for a run no worker can report: it died serving it."""
    await bus.publish_event(wire.RunFinished(
        model=request.model, node=node, request_id=request.request_id, api=request.api,
        principal=request.principal, status=RunStatus.ERROR, finish_reason=FinishReason.ERROR,
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=0, attempt=max(attempt, 1), queue_ms=0.0,
        ttft_ms=None, prefill_ms=0.0, decode_ms=0.0,
        e2e_ms=round((time.time() - request.created_at) * 1000.0, 3), error=error,
    ))


# Failures where the worker is gone and cannot report the run itself.
_LOST = ("worker_lost", "delivery_failed")


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(slots=True, weakref_slot=True)
class Generation:
    request: wire.GenerateRequest
    reply: ReplyStream
    bus: GatewayBus
    accepted: wire.Accepted
    idle_timeout_s: float
    handler: str
    finished: bool = False
    ticket: Ticket | None = None
    # A first frame that was not `Accepted` (a worker that skipped it): read before the stream.
    held: wire.ReplyFrame | None = None

    @property
    def node(self) -> str:
        return self.accepted.node

    def _take_held(self) -> wire.ReplyFrame | None:
        frame, self.held = self.held, None
        return frame

    async def frames(self) -> AsyncIterator[wire.Delta | wire.Final]:
        """Deltas then one Final; raises ServingError on an error frame or a silent worker.

        Silence before any text means the worker may have died holding the request: JetStream
        hands it to another worker after its ack wait, so we keep waiting as a queued request
        would, up to its deadline (workers drop it after that; the max-deliveries advisory ends
        it sooner when every delivery's worker died). Silence after text is final:
        the text cannot be taken back, so the client gets an error and later attempts are ignored.
        """
        metrics, model = self.bus.metrics, self.request.model
        last_text_at: float | None = None
        completion_tokens = 0
        attempts: int | None = None
        try:
            while True:
                try:
                    frame = self._take_held() or await self.reply.next(self.idle_timeout_s)
                except ReplyTimeout:
                    if last_text_at is None and time.time() < self.request.deadline:
                        continue
                    raise ServingError(503, "worker_lost", "The worker serving this request stopped responding.")
                if isinstance(frame, wire.Accepted):
                    self.accepted = frame
                    continue
                if isinstance(frame, wire.Heartbeat):
                    continue
                if isinstance(frame, wire.ErrorFrame):
                    if frame.code == "delivery_failed":
                        attempts = frame.attempt - 1  # the gateway's own frame comes after the last attempt
                    raise ServingError(frame.status, frame.code, frame.message)
                now = time.time()
                if isinstance(frame, wire.Delta):
                    completion_tokens += frame.num_tokens
                if isinstance(frame, wire.Delta) and (frame.text or frame.reasoning or frame.tool_calls):
                    self.reply.lock()
                    if last_text_at is None:
                        metrics.ttft.labels(model).observe(max(now - self.request.created_at, 0.0))
                    else:
                        metrics.itl.labels(model).observe(now - last_text_at)
                    last_text_at = now
                if isinstance(frame, wire.Final):
                    self.finished = True
                    metrics.e2e.labels(model).observe(max(now - self.request.created_at, 0.0))
                    metrics.prompt_tokens.labels(model).inc(frame.usage.prompt_tokens)
                    metrics.generation_tokens.labels(model).inc(frame.usage.completion_tokens)
                    metrics.outcomes.labels(model, frame.finish_reason).inc()
                yield frame
                if self.finished:
                    return
        except ServingError as exc:
            self.finished = True
            if exc.code in _LOST:
                # Whatever attempt comes next must not serve a client that is already answered.
                self.bus.cancel_soon(self.request.request_id)
                await record_failed_run(self.bus, self.request, self.node, attempts or self.reply.attempt, exc.code,
                                        self.accepted.prompt_tokens, completion_tokens)
            metrics.errors.labels(model, str(exc.status)).inc()
            log_failure(self.handler, exc.status, exc.message, model=self.request.model, node=self.node,
                        request_id=self.request.request_id)
            raise

    async def close(self) -> None:
        """Stop the work if the client left early, give back the admission slot, stop listening."""
        if not self.finished:
            self.bus.cancel_soon(self.request.request_id)
            self.finished = True
        if self.ticket is not None:
            self.ticket.release()
        await self.reply.close()


_ADMISSION_MESSAGES = {
    "queue_full": ("The model's queue is full; retry later.", "queue_full"),
    "principal_cap": ("Too many concurrent requests for this API key; retry later.", "rate_limit_exceeded"),
    "timeout": ("The model is busy and the request waited too long; retry later.", "queue_timeout"),
}


async def admit(bus: GatewayBus, request: wire.GenerateRequest) -> Ticket:
    """Take an admission slot for the request, or refuse it (429/503 with Retry-After); every
    decision is published on EVENTS."""
    admission = bus.admission(request.model)

    def decided(decision: str, **fields: object) -> wire.AdmissionDecided:
        return wire.AdmissionDecided(model=request.model, node="gateway", request_id=request.request_id,
                                     principal=request.principal, decision=wire.AdmissionDecision(decision),
                                     **fields)  # type: ignore[arg-type]

    try:
        ticket = await admission.acquire(request.principal)
    except Rejected as exc:
        bus.metrics.rejections.labels(request.model, exc.decision).inc()
        await bus.publish_event(decided(exc.decision, pending=exc.pending, in_flight=exc.in_flight,
                                        retry_after_s=exc.retry_after))
        message, code = _ADMISSION_MESSAGES[exc.decision]
        raise ServingError(
            exc.status,
            code,
            message,
            retry_after_s=exc.retry_after,
            context={"model": request.model, "request_id": request.request_id, "detail": exc.decision},
        )
    except asyncio.CancelledError:
        await asyncio.shield(bus.publish_event(decided("cancelled", pending=admission.pending,
                                                       in_flight=admission.in_flight)))
        raise
    await bus.publish_event(decided("admitted", pending=admission.pending, in_flight=admission.in_flight,
                                    waited_ms=round(ticket.waited_ms, 3)))
    return ticket


async def _until_disconnected(client: Request) -> None:
    # The body has been read, so the next ASGI message can only be the client hanging up.
    while (await client.receive())["type"] != "http.disconnect":
        pass


async def _admit_while_connected(bus: GatewayBus, request: wire.GenerateRequest, client: Request | None) -> Ticket:
    """Queue for a slot, but give the reservation back at once if the client hangs up meanwhile."""
    if client is None:
        return await admit(bus, request)
    admission = asyncio.create_task(admit(bus, request))
    hangup = asyncio.create_task(_until_disconnected(client))
    try:
        await asyncio.wait({admission, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not admission.done():
            admission.cancel()
    try:
        return await admission
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise
        raise ServingError(
            499,
            ErrorCode.CLIENT_CLOSED,
            "The client closed the request.",
            context={"model": request.model, "request_id": request.request_id,
                                "detail": "client left while queued"},
        ) from None


async def start_generation(
    bus: GatewayBus,
    settings: GatewaySettings,
    request: wire.GenerateRequest,
    handler: str,
    client: Request | None = None,
) -> Generation:
    """Admit, publish and wait for the worker's first frame; any failure so far is an ServingError.
    With `client`, a hang-up while queued for admission releases the reservation at once."""
    ticket = await _admit_while_connected(bus, request, client)
    try:
        # The wait for a worker starts once admitted.
        request = msgspec.structs.replace(request, deadline=time.time() + settings.accept_timeout_s)
        generation = await _publish_and_wait(bus, settings, request, handler)
    except BaseException:
        ticket.release()
        raise
    generation.ticket = ticket
    # A streamed response whose body is never iterated (the client left first) never runs its
    # cleanup; the slot must come back all the same.
    weakref.finalize(generation, ticket.release)
    return generation


async def _publish_and_wait(
    bus: GatewayBus,
    settings: GatewaySettings,
    request: wire.GenerateRequest,
    handler: str,
) -> Generation:
    ctx = {"model": request.model, "request_id": request.request_id}
    try:
        reply = await bus.submit(request)
    except (nats.errors.Error, TimeoutError) as exc:
        # E.g. a NATS server of the cluster died and its streams are electing new leaders.
        bus.metrics.rejections.labels(request.model, "bus_unavailable").inc()
        raise ServingError(
            503,
            ErrorCode.BUS_UNAVAILABLE,
            "The request could not be queued (the message bus is unavailable); retry shortly.",
            retry_after_s=retry_after_s(),
            context={**ctx, "detail": f"publish failed: {exc!r}"},
        ) from None
    try:
        frame = await reply.next(max(request.deadline - time.time(), 0.001))
    except ReplyTimeout:
        bus.cancel_soon(request.request_id)
        bus.metrics.rejections.labels(request.model, "timeout").inc()
        await reply.close()
        raise ServingError(
            503,
            ErrorCode.QUEUE_TIMEOUT,
            "The model is busy and the request was not started in time; retry later.",
            retry_after_s=retry_after_s(),
            context={**ctx, "detail": "no worker accepted before the deadline"},
        ) from None
    except BaseException:
        bus.cancel_soon(request.request_id)
        await reply.close()
        raise
    bus.metrics.queue.labels(request.model).observe(max(time.time() - request.created_at, 0.0))
    if isinstance(frame, wire.ErrorFrame):
        bus.metrics.errors.labels(request.model, str(frame.status)).inc()
        if frame.code in _LOST:
            await record_failed_run(bus, request, reply.node or "unknown", frame.attempt - 1, frame.code)
        if frame.code == "context_length_exceeded":
            bus.metrics.rejections.labels(request.model, frame.code).inc()
        await reply.close()
        raise ServingError(frame.status, frame.code, frame.message, context={**ctx, "node": reply.node})
    accepted = frame if isinstance(frame, wire.Accepted) else wire.Accepted(
        seq=0, node=reply.node or "unknown", prompt_tokens=0)
    return Generation(
        request=request,
        reply=reply,
        bus=bus,
        accepted=accepted,
        idle_timeout_s=settings.stream_idle_timeout_s,
        handler=handler,
        held=None if frame is accepted else frame,
    )

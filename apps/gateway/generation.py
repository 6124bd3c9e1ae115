"""One generation's life: route → check token ids, bound the answer → admit → publish → first
frame → frames → release.

Every generation endpoint reads its body through `BodyReader` (`apps.gateway.body_reading`),
builds its bus request and hands it, with a `Formatter` for its API (`apps.gateway.rendering`), to
`GenerationPipeline.serve`; the pipeline owns the sequence, the formatter only shapes what the
client sees. The HTTP status is committed only after the worker's first frame
(`apps.gateway.first_frame`), so errors before the first token are real statuses even for
`stream: true`; a failure after it is an error event.

The client is watched in every phase: until the first frame for a stream, until the whole answer
otherwise. When it leaves, the phase it was in is cancelled, and cancelling any phase releases
the admission slots and publishes the cancel, so the worker stops and frees the KV cache.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable

import msgspec
from litestar import Request
from litestar.response import Response, Stream

from apps.bus import wire
from apps.bus.codes import ErrorCode, FinishReason, ServingError, Unavailable, unavailable
from apps.gateway.admission import Admissions
from apps.gateway.api.validate import bound_output, bound_whole_logprobs, check_prompt_size, check_token_ids
from apps.gateway.body_reading import arriving
from apps.gateway.bus_client import GatewayBus
from apps.gateway.cold_start import ColdStarts
from apps.gateway.errors import log_failure, request_id_headers
from apps.gateway.events import EventPublisher
from apps.gateway.first_frame import FirstFrames, Generation
from apps.gateway.generation_metrics import GenerationMetrics
from apps.gateway.liveness import Canceller, ClientGone, next_live_frame, while_connected
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.migration import LOST, MIGRATABLE, Delivered, Migrator
from apps.gateway.rendering import Formatter, sse_chunks, whole_response
from apps.settings import GatewaySettings


class GenerationPipeline:
    def __init__(self, bus: GatewayBus, cold_starts: ColdStarts, admissions: Admissions, canceller: Canceller,
                 events: EventPublisher, metrics: GatewayMetrics, settings: GatewaySettings,
                 batch_load: Callable[[str], bool] | None = None) -> None:
        self._bus = bus
        self._cold_starts = cold_starts
        self._admissions = admissions
        self._canceller = canceller
        self._events = events
        self._metrics = GenerationMetrics(metrics, batch_load)
        self._migrator = Migrator(bus, events, self._metrics, settings)
        self._settings = settings
        self.first_frames = FirstFrames(bus, canceller, self._metrics, self._migrator, settings)

    async def serve(self, client: Request | None, request: wire.GenerateRequest, formatter: Formatter,
                    handler: str, output_param: str = "max_tokens") -> Response | Stream:
        """The whole answer to one API request, or its SSE stream once the worker has answered.
        `output_param` is what the client's API calls the answer's length limit (for its 400)."""
        headers = request_id_headers(request.request_id)
        if client is not None:
            request = msgspec.structs.replace(request, arriving=arriving(client))
        try:
            if not request.stream:
                return await while_connected(client, self._whole(request, formatter, handler, headers, output_param))
            generation = await while_connected(client, self._routed_start(request, handler, output_param),
                                               discard=lambda g: asyncio.ensure_future(self.close(g)))
        except ClientGone:
            raise ServingError(
                499,
                ErrorCode.CLIENT_CLOSED,
                "The client closed the request.",
                context={"model": request.model, "request_id": request.request_id, "detail": "client left"},
            ) from None
        return Stream(self._sse(generation, formatter), media_type="text/event-stream",
                      headers={**headers, "Cache-Control": "no-cache"})

    async def _routed_start(self, request: wire.GenerateRequest, handler: str, output_param: str) -> Generation:
        nodes = await self._cold_starts.nodes_for(request.model)
        check_token_ids(request, nodes)
        check_prompt_size(request, nodes)
        try:
            length_defaulted = request.sampling.max_tokens is None
            request = bound_whole_logprobs(bound_output(request, nodes, output_param), length_defaulted)
        except ServingError as exc:
            self._metrics.rejected(request.model, exc.code)
            exc.context.update(model=request.model, request_id=request.request_id)
            raise
        return await self.start(request, handler)

    async def start(self, request: wire.GenerateRequest, handler: str) -> Generation:
        """Admit, publish and wait for the worker's first frame; any failure so far is a ServingError.
        Cancelled at any await, it gives back what it holds (slots, subscriptions) and cancels."""
        self._events.check_room(request.model)
        ticket = await self._admissions.admit(request)
        try:
            # The wait for a worker starts once admitted: the one place the deadline is set.
            request = msgspec.structs.replace(request, reply_subject=self._bus.new_reply_subject(),
                                              deadline=time.time() + self._settings.accept_timeout_s)
            generation = await self.first_frames.wait(request, handler)
        except BaseException:
            ticket.release()
            raise
        generation.ticket = ticket
        # A streamed response whose body is never iterated (the client left first) never runs its
        # cleanup; the slot must come back all the same.
        weakref.finalize(generation, ticket.release)
        return generation

    async def frames(self, generation: Generation) -> AsyncIterator[wire.Delta | wire.Final]:
        """Deltas then one Final; raises ServingError on an error frame or a lost worker.

        Silence before any delta means the worker may have died holding the request: JetStream
        hands it to another worker after its ack wait, so we keep waiting as a queued request
        would, up to its deadline (workers drop it after that; the max-deliveries advisory ends
        it sooner when every delivery's worker died). Silence after one means the worker is
        lost: the request migrates to another worker from what the client has
        (`apps.gateway.migration`), up to `max_migrations` times; then the client gets the error.
        """
        reply, model = generation.reply, generation.request.model
        timer = self._metrics.answer(generation.request)
        delivered = Delivered(generation.request.sampling.n)
        completion_tokens = 0  # of the current attempt
        attempts: int | None = None
        migrations = 0
        try:
            while True:
                try:
                    frame = generation.held or await next_live_frame(
                        generation.reply, self._settings.stream_idle_timeout_s, generation.request.deadline)
                    generation.held = None
                    _raise_if_cut_short(frame)
                except ServingError as exc:
                    if not self._migrator.may_migrate(exc, reply, migrations):
                        raise
                    generation.request = await self._migrator.migrate(
                        generation.request, reply, generation.node, generation.accepted.prompt_tokens, delivered,
                        exc, completion_tokens)
                    migrations += 1
                    completion_tokens = 0
                    continue
                if isinstance(frame, wire.Accepted):
                    generation.accepted = frame
                    continue
                if isinstance(frame, wire.Heartbeat):
                    continue
                if isinstance(frame, wire.ErrorFrame):
                    if frame.code == ErrorCode.DELIVERY_FAILED:
                        attempts = frame.attempt - 1  # the gateway's own frame comes after the last attempt
                    raise ServingError(frame.status, frame.code, frame.message)
                if isinstance(frame, wire.Delta):
                    completion_tokens += frame.num_tokens
                    delivered.add(frame)
                    # Any delta is the client's (its tokens count, their logprobs show, its text
                    # may be held back): the attempt that sent it is the answer from now on.
                    reply.lock()
                if isinstance(frame, wire.Final):
                    generation.finished = True
                timer.frame(frame)
                yield frame
                if generation.finished:
                    return
        except ServingError as exc:
            generation.finished = True
            request = generation.request
            if exc.code in LOST or exc.code == ErrorCode.FRAMES_LOST:
                # Whatever attempt comes next must not serve a client that is already answered.
                self._canceller.cancel_soon(request.request_id)
                self._migrator.record_lost_run(request, generation.node, attempts or reply.attempt, exc.code,
                                               generation.accepted.prompt_tokens, completion_tokens)
            elif exc.code == ErrorCode.GATEWAY_STOPPING:
                self._canceller.cancel_soon(request.request_id)  # its worker is still answering
            self._metrics.errored(model, exc.status)
            log_failure(generation.handler, exc.status, exc.message, model=model, node=generation.node,
                        request_id=request.request_id)
            raise
        finally:
            timer.close()

    async def close(self, generation: Generation) -> None:
        """Stop the work if the client left early, give back the admission slot, stop listening."""
        if not generation.finished:
            self._canceller.cancel_soon(generation.request.request_id)
            generation.finished = True
        if generation.ticket is not None:
            generation.ticket.release()
        await generation.reply.close()

    async def _whole(self, request: wire.GenerateRequest, formatter: Formatter, handler: str,
                     headers: dict[str, str], output_param: str) -> Response:
        generation = await self._routed_start(request, handler, output_param)
        try:
            return await whole_response(self.frames(generation), formatter, headers)
        finally:
            await self.close(generation)

    def _sse(self, generation: Generation, formatter: Formatter) -> AsyncIterator[bytes]:
        return sse_chunks(generation.accepted, self.frames(generation), formatter, lambda: self.close(generation))


def _raise_if_cut_short(frame: wire.ReplyFrame) -> None:
    """An error frame of a migratable kind, or an answer the worker ended on its own (`abort`: the
    gateway did not ask for it), as a ServingError: the answer goes on elsewhere or fails."""
    if isinstance(frame, wire.ErrorFrame) and frame.code in MIGRATABLE:
        raise ServingError(frame.status, frame.code, frame.message)
    if isinstance(frame, wire.Final) and frame.finish_reason == FinishReason.ABORT:
        # E.g. the worker could not reach this gateway for a while: the answer is not complete.
        raise unavailable(Unavailable.WORKER_ABORTED)

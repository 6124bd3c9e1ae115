"""One model on one worker: serve each request its intake hands over, settle it, hand back on stop.

The model's intake (`apps.worker.intake`) pulls only what fits in this loop's free slots and
hands over each request it may serve. Each becomes one run (`run.run_request`); while it runs,
`liveness.keep_alive` touches it (heartbeat frame + in-progress ack) every heartbeat, so a dead
worker's requests go to another worker after the consumer's short ack wait, and at most
max_deliver times. Once the run is over its `run.finished` event is published, then the message
is acked (terminated, when no worker could prepare it; left alone, when the run lost its request
to another attempt, which holds the message now). Publishing first means a failed ack leaves a
redelivery, never a ledger row "running" forever.

Stopping (SIGTERM) hands work back: every held request whose client has had no text yet is nak'ed
at once, so another worker takes it without waiting out the ack wait, and its engine request
aborted, its replier silenced; the streams with text get `stop_grace_s` to finish, then end with a
`worker_stopping` error frame (a requester may migrate them), never with a normal finish.

What the loop needs of its worker (the bus connection, the node id, the cancelled ids, where to
say the node entry changed) is handed down in a `NodeBus` when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import nats.errors
from nats.aio.msg import Msg

from apps.bus import event_builders, topology, wire
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.event_publish import publish_event
from apps.bus.events import AdmissionDecision, RunFinished
from apps.settings import WorkerSettings
from apps.worker import liveness
from apps.worker.context_limit import ContextLimit
from apps.worker.frame_window import FrameWindow
from apps.worker.intake import Held, Intake, NodeBus, holds, interactive_reserve
from apps.worker.replies import Replier
from apps.worker.run import ModelHealth, ServedModel, abort_request, run_request
from apps.worker.tokenizing import Tokenizing
from engine.frontend.protocol import Engine, ServiceClass
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger("helexa.worker")


class ModelLoop:
    def __init__(self, settings: WorkerSettings, engine: Engine, tokenizer: Tokenizer, model_id: str,
                 source: str = "", memory_mb: int = 0) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.source = source
        self.memory_mb = memory_mb
        self.active: dict[str, asyncio.Task[None]] = {}
        self.requests: dict[str, wire.GenerateRequest] = {}
        # What is known of each held request's message and run (a redelivery is told from a reused
        # id by the message's stream sequence).
        self._held: dict[str, Held] = {}
        self.intake = Intake(model_id, engine, self._held,
                             interactive_reserve(settings.interactive_reserve, engine.max_num_seqs))
        info = engine.info
        self.context = ContextLimit(
            max_position_embeddings=info.max_position_embeddings or engine.max_model_len,
            # Engines without a paged pool (the scripted one) report no blocks: no KV ceiling.
            kv_pool_tokens=info.num_blocks * info.block_size or None,
            hard_cap=settings.max_model_len or None,
            prefill_bound=info.num_blocks > 0,
        )
        self.health = ModelHealth(model_id)
        # One window for the model's streams, paced by its engine's steps.
        self.frame_window = FrameWindow(settings.frame_window_ms / 1000, settings.frame_window_steps,
                                        lambda: self.engine.stats)
        self.model = ServedModel(model_id, engine, tokenizer, self.context, self.health,
                                 Tokenizing(tokenizer, processes=settings.tokenize_processes),
                                 reasoning_parser=settings.reasoning_parser)

    @property
    def poisoned(self) -> str | None:
        return self.health.poisoned

    async def start(self, bus: NodeBus) -> None:
        self.bus = bus
        self.health.changed = bus.status_changed
        await self.intake.start(bus, self.free_slots, self._begin)

    async def stop(self, grace_s: float | None = None) -> None:
        """Pull nothing more; hand back what has sent no text; give the streams with text
        `grace_s` (the settings' stop grace by default) to finish, then end them with a
        `worker_stopping` error; free the engine."""
        await self.intake.stop()
        for held in list(self._held.values()):
            if held.msg is not None and not held.sent_text:
                await self.intake.hand_back(held)
        if self.active:
            await asyncio.wait(set(self.active.values()),
                               timeout=self.settings.stop_grace_s if grace_s is None else grace_s)
        for held in list(self._held.values()):
            if held.handed_back:
                continue
            if held.replier is not None:
                with contextlib.suppress(nats.errors.Error):  # a closed connection reaches nobody anyway
                    await held.replier.error(503, ErrorCode.WORKER_STOPPING,
                                             "The worker serving this request stopped before the answer was complete.")
                held.replier.silence(ErrorCode.WORKER_STOPPING)
            await self.abort(held.request)
        if self.active:
            await asyncio.wait(set(self.active.values()), timeout=5.0)
        self.model.tokenizing.close()
        await self.engine.shutdown()

    def _begin(self, held: Held) -> None:
        assert held.msg is not None  # the intake hands over pulled messages only
        request = held.request
        self._claim(held)
        task = asyncio.create_task(self._serve(held.msg, request))
        self.active[request.request_id] = task
        task.add_done_callback(lambda _: self._finished(request.request_id))

    def _claim(self, held: Held) -> None:
        self.requests[held.request.request_id] = held.request
        self._held[held.request.request_id] = held

    def _finished(self, request_id: str) -> None:
        self.active.pop(request_id, None)
        self.requests.pop(request_id, None)
        self._held.pop(request_id, None)
        self.intake.wake()

    async def _serve(self, msg: Msg, request: wire.GenerateRequest) -> None:
        try:
            await self._serve_message(msg, request)
        except Exception:  # never a silent end: the message is redelivered once its ack wait passes
            log.exception("serving a request failed", extra={"request_id": request.request_id})

    async def _serve_message(self, msg: Msg, request: wire.GenerateRequest) -> None:
        held = self._held[request.request_id]
        cancelled = request.request_id in self.bus.cancelled
        if cancelled or (request.deadline and time.time() > request.deadline):
            # Its client has already been answered (a 503 or a hang-up): nobody waits for it.
            log.info("dropped request nobody waits for", extra={"request_id": request.request_id})
            await self.intake.settle(msg, held.ref, terminate=True)
            decision = AdmissionDecision.CANCELLED if cancelled else AdmissionDecision.TIMEOUT
            await publish_event(self.bus.js, event_builders.admission_decided(
                request.model, request.request_id, request.principal, decision, node=self.bus.node,
                detail="dropped by the worker: nobody waits for it", pending=len(self.active),
                in_flight=len(self.active),
            ), subject_kind=topology.DROPPED)  # admission events are the gateways' own
            return
        attempt = liveness.attempt_of(request, msg.metadata.num_delivered)
        replier = held.replier = Replier(self.bus.nc, request.reply_subject, attempt, self.bus.node,
                                           frame_window=self.frame_window)
        if attempt > 1 and request.liveness_probe and not await liveness.still_wanted(
                self.bus.nc, request.reply_subject, attempt):
            # Another attempt serves its client (or nobody waits any more): this one must not run.
            log.info("redelivered request no longer wanted", extra={"request_id": request.request_id,
                                                                    "attempt": attempt})
            await self.intake.settle(msg, held.ref, terminate=True)
            return
        if held.handed_back:
            return  # the worker stopped meanwhile and gave it back
        probe = None
        if request.liveness_probe:
            probe = liveness.RequesterProbe(self.bus.nc, request.reply_subject, attempt,
                                            grace_s=self.settings.requester_grace_s)
        keep_alive = asyncio.create_task(liveness.keep_alive(replier, self.settings.heartbeat_s, msg.in_progress))
        try:
            outcome = await run_request(self.model, request, replier, attempt=attempt, node=self.bus.node,
                                        js=self.bus.js, probe=probe)
        finally:
            keep_alive.cancel()
        # The ledger first: an ack that fails then leaves a redelivery, not a run "running" forever.
        await publish_event(self.bus.js, outcome.finished)
        if held.handed_back or replier.silenced == ErrorCode.ATTEMPT_TAKEN:
            # Nak'ed already, or held now by the attempt that serves the client: an ack from here
            # would settle the message under that attempt (acks name it by its stream sequence).
            return
        await self.intake.settle(msg, held.ref, terminate=outcome.terminate)

    async def serve_once(self, request: wire.GenerateRequest, replier: Replier) -> RunFinished:
        """One request not pulled from the consumer (the `generate` endpoint), served the same way;
        it takes its slots like any other, and is refused (503 `queue_full`) when they are not free, as
        the intake would leave it on the stream (a batch-class one also when it would take the
        interactive reserve). Raises ServingError (409) for an id already running here."""
        if holds(self._held, request):
            raise ServingError(409, ErrorCode.INVALID_REQUEST, "A request with this id is already running.")
        most = self.engine.max_num_seqs - (self.intake.reserve if request.service_class == ServiceClass.BATCH else 0)
        if request.sampling.n > most:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, f"'n' is {request.sampling.n}; this worker runs at "
                                                               f"most {most} sequences at once for such a request.")
        if self.intake.room(request.service_class) < request.sampling.n:
            raise ServingError(503, ErrorCode.QUEUE_FULL, "This worker has no free sequence for the request "
                                                          "now: ask again later, or ask another node.")
        self._claim(Held(request, replier=replier))
        try:
            outcome = await run_request(self.model, request, replier, attempt=1, node=self.bus.node, js=self.bus.js)
        finally:
            self._finished(request.request_id)
        return outcome.finished

    async def abort(self, request: wire.GenerateRequest) -> None:
        await abort_request(self.engine, request)

    def wake(self) -> None:
        """Look for requests again now: the engine has slots again (a new core after a restart)."""
        self.intake.wake()

    def free_slots(self, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
        """Engine sequences not promised to a pulled request (a request takes one per choice), for
        a request of `service_class`."""
        if self.engine.free_slots(service_class) <= 0:
            return 0  # e.g. the engine process is gone
        stats = self.engine.stats
        # Batch work waiting in the engine does not hold an interactive request back: the scheduler
        # takes it first, preempting batch sequences where it must.
        waiting = stats.num_waiting
        if service_class == ServiceClass.INTERACTIVE:
            waiting -= stats.num_batch_waiting
        if waiting > 0:
            # The engine already holds work it has no KV blocks (or batch room) for: more would
            # only wait here, where another worker might have served it at once.
            return 0
        # Interactive work does not count the seats batch work holds: the scheduler preempts batch
        # sequences for it (they keep their tokens and resume first among batch work).
        counted = self.requests.values() if service_class == ServiceClass.BATCH else (
            r for r in self.requests.values() if r.service_class != ServiceClass.BATCH)
        promised = sum(r.sampling.n for r in counted) + self.intake.fetching
        return max(self.engine.max_num_seqs - promised, 0)

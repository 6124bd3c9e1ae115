"""One model on one worker: pull what fits from the model's shared consumer, serve, settle.

It fetches only as many requests as it has free slots, so JetStream spreads work across the
workers of a model by capacity with no router of our own. Each pulled message becomes one run
(`run.run_request`); while it runs, `liveness.keep_alive` touches it (heartbeat frame +
in-progress ack) every heartbeat, so a dead worker's requests go to another worker after the
consumer's short ack wait, and at most max_deliver times. Once the run is over its `run.finished`
event is published, then the message is acked (terminated, when no worker could prepare it; left
alone, when the run lost its request to another attempt, which holds the message now). Publishing
first means a failed ack leaves a redelivery, never a ledger row "running" forever.

Stopping (SIGTERM) hands work back: every held request whose client has had no text yet is nak'ed
at once, so another worker takes it without waiting out the ack wait, and its engine request
aborted, its replier silenced; the streams with text get `stop_grace_s` to finish, then end with a
`worker_stopping` error frame (a requester may migrate them), never with a normal finish.

The engine never sees a request id twice: a redelivery of a message still running here is left to
its run, a newer attempt of a request running here (its requester migrated it) takes over from the
run here, which lost, and any other message reusing a running id is refused alone (409, terminated). A request
whose reply subject the server would refuse is terminated unanswered, since publishing on it would
cost this worker its connection.

What the loop needs of its worker (the bus connection, the node id, the cancelled ids, where to
say the node entry changed) is handed down in a `NodeBus` when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Container
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from apps.bus import large_requests, topology, wire
from apps.bus.codes import ErrorCode, ModelState, ServingError
from apps.bus.publish import publish_event
from apps.settings import WorkerSettings
from apps.worker import liveness
from apps.worker.choices import engine_request_ids
from apps.worker.context_limit import ContextLimit
from apps.worker.replies import Replier
from apps.worker.run import ModelHealth, ServedModel, abort_request, run_request
from apps.worker.tokenizing import Tokenizing
from engine.frontend.protocol import Engine
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger("helexa.worker")


@dataclass(slots=True)
class Held:
    """A request this loop holds: its message (None for the one-shot `generate` endpoint), and its
    run's replier once the run has one."""

    request: wire.GenerateRequest
    msg: Msg | None = None
    replier: Replier | None = None
    # Where the request came from when it was too large for its message (deleted once settled).
    ref: wire.RequestRef | None = None
    # Nak'ed by a stopping worker before any text: another worker serves it; this run must not
    # touch the message again.
    handed_back: bool = False

    @property
    def stream_seq(self) -> int | None:
        return self.msg.metadata.sequence.stream if self.msg is not None else None

    @property
    def sent_text(self) -> bool:
        return self.replier is not None and self.replier.sent_tokens


@dataclass(slots=True, frozen=True)
class NodeBus:
    """What a model loop uses of its worker, handed down when the loop starts."""

    nc: NatsClient
    js: JetStreamContext
    node: str
    limits: topology.BusLimits
    # Requests cancelled before they were pulled: dropped unserved when they are.
    cancelled: Container[str]
    # Set when the node entry should be refreshed now (a model was poisoned).
    status_changed: asyncio.Event


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
        # Large requests whose body is being fetched from the Object Store (each takes a slot).
        self._fetching = 0
        self._slot_freed = asyncio.Event()
        self._stop = asyncio.Event()
        self._pulling: asyncio.Task[None] | None = None
        info = engine.info
        self.context = ContextLimit(
            max_position_embeddings=info.max_position_embeddings or engine.max_model_len,
            # Engines without a paged pool (the scripted one) report no blocks: no KV ceiling.
            kv_pool_tokens=info.num_blocks * info.block_size or None,
            hard_cap=settings.max_model_len or None,
            prefill_bound=info.num_blocks > 0,
        )
        self.health = ModelHealth(model_id)
        self.model = ServedModel(model_id, engine, tokenizer, self.context, self.health,
                                 Tokenizing(tokenizer, processes=settings.tokenize_processes),
                                 reasoning_parser=settings.reasoning_parser)

    @property
    def poisoned(self) -> str | None:
        return self.health.poisoned

    async def start(self, bus: NodeBus) -> None:
        self.bus = bus
        self.health.changed = bus.status_changed
        subscription = await topology.worker_subscription(bus.js, self.model_id, bus.limits)
        self._pulling = asyncio.create_task(self._pull_loop(subscription))

    async def stop(self, grace_s: float | None = None) -> None:
        """Pull nothing more; hand back what has sent no text; give the streams with text
        `grace_s` (the settings' stop grace by default) to finish, then end them with a
        `worker_stopping` error; free the engine."""
        self._stop.set()
        if self._pulling is not None:
            await self._pulling
        for held in list(self._held.values()):
            if held.msg is not None and not held.sent_text:
                await self._hand_back(held)
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

    async def _hand_back(self, held: Held) -> None:
        """A request whose client has had no text goes back to JetStream now, for another worker;
        nothing more from here reaches its client."""
        assert held.msg is not None
        held.handed_back = True
        if held.replier is not None:
            held.replier.silence(ErrorCode.WORKER_STOPPING)
        log.info("handed back: the worker is stopping", extra={"request_id": held.request.request_id})
        try:
            await held.msg.nak()
        except nats.errors.Error as exc:  # the connection is gone: the ack wait hands it on instead
            log.warning("nak failed", extra={"request_id": held.request.request_id, "error": repr(exc)})
        await self.abort(held.request)

    async def _pull_loop(self, subscription: Any) -> None:
        stopping = asyncio.create_task(self._stop.wait())
        try:
            while not self._stop.is_set():
                free = self.free_slots()
                if free <= 0:
                    self._slot_freed.clear()
                    freed = asyncio.create_task(self._slot_freed.wait())
                    await asyncio.wait({freed, stopping}, return_when=asyncio.FIRST_COMPLETED)
                    freed.cancel()
                    continue
                try:
                    msgs = await subscription.fetch(batch=free, timeout=1.0)
                except TimeoutError:  # nats-py raises its own or asyncio's; both are TimeoutError
                    continue
                except nats.errors.Error as exc:
                    log.warning("fetch failed", extra={"model": self.model_id, "error": str(exc)})
                    await asyncio.wait({stopping}, timeout=1.0)
                    continue
                for msg in msgs:
                    self._start(msg)
        finally:
            stopping.cancel()
            try:
                await subscription.unsubscribe()
            except nats.errors.Error:
                pass

    def _start(self, msg: Msg) -> None:
        try:
            body = wire.decode_request(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable request terminated", extra={"error": str(exc)})
            asyncio.create_task(msg.term())
            return
        if isinstance(body, wire.RequestRef):
            self._fetching += 1  # it takes its slot while its body comes
            asyncio.create_task(self._start_large(msg, body))
            return
        self._begin(msg, body)

    async def _start_large(self, msg: Msg, ref: wire.RequestRef) -> None:
        """A request too large for its message: fetched from the Object Store, then as any other."""
        try:
            request = await large_requests.fetch(self.bus.js, ref)
        except (large_requests.RequestGone, large_requests.RequestRefused, msgspec.DecodeError) as exc:
            log.warning("large request unreadable; terminated", extra={"request_id": ref.request_id,
                                                                       "error": str(exc)})
            await self._settle(msg, ref, terminate=True)
            return
        except (nats.errors.Error, TimeoutError) as exc:
            # The bus is unwell: another delivery (here or elsewhere) tries again.
            log.warning("large request not fetched; left for redelivery",
                        extra={"request_id": ref.request_id, "error": repr(exc)})
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=1.0)
            return
        finally:
            self._fetching -= 1
            self._slot_freed.set()
        self._begin(msg, request, ref)

    def _begin(self, msg: Msg, request: wire.GenerateRequest, ref: wire.RequestRef | None = None) -> None:
        if request.model != self.model_id:
            # This consumer delivers only this model's subject, which a gateway names for the
            # request's own model: anything else was not put there by a gateway.
            log.warning("request for another model on this model's consumer terminated",
                        extra={"request_id": request.request_id, "model": self.model_id})
            asyncio.create_task(self._settle(msg, ref, terminate=True))
            return
        if not topology.valid_reply_subject(request.reply_subject):
            # Publishing on it could make the server close this worker's connection for good.
            log.warning("request with an unusable reply subject terminated",
                        extra={"request_id": request.request_id, "bytes": len(request.reply_subject.encode())})
            asyncio.create_task(self._settle(msg, ref, terminate=True))
            return
        if self._holds(request):
            asyncio.create_task(self._refuse_duplicate(msg, request, ref))
            return
        self._claim(Held(request, msg, ref=ref))
        task = asyncio.create_task(self._serve(msg, request))
        self.active[request.request_id] = task
        task.add_done_callback(lambda _: self._finished(request.request_id))

    def _holds(self, request: wire.GenerateRequest) -> bool:
        """Whether one of `request`'s engine ids is already running here: the engine core must never
        see an id twice (it cannot tell the two apart and fails)."""
        running = {rid for held in self.requests.values()
                   for rid in engine_request_ids(held.request_id, held.sampling.n)}
        return any(rid in running for rid in engine_request_ids(request.request_id, request.sampling.n))

    def _claim(self, held: Held) -> None:
        self.requests[held.request.request_id] = held.request
        self._held[held.request.request_id] = held

    def _finished(self, request_id: str) -> None:
        self.active.pop(request_id, None)
        self.requests.pop(request_id, None)
        self._held.pop(request_id, None)
        self._slot_freed.set()

    async def _settle(self, msg: Msg, ref: wire.RequestRef | None, *, terminate: bool) -> None:
        """Ack (or terminate) a message for good; a large request's object goes with it."""
        await (msg.term() if terminate else msg.ack())
        if ref is not None:
            await large_requests.delete(self.bus.js, ref)

    async def _refuse_duplicate(self, msg: Msg, request: wire.GenerateRequest,
                                ref: wire.RequestRef | None = None) -> None:
        running = self._held.get(request.request_id)
        held = running.request if running is not None else None
        if running is not None and running.stream_seq == msg.metadata.sequence.stream:
            # JetStream redelivered the message this worker is still running (its in-progress acks
            # came late). Acks name a message by its stream sequence, whichever delivery they came
            # with, so the running attempt still holds this one: it goes on touching it and acks it
            # when done. A nak would only have it redelivered again; an ack or a term would settle
            # it while the run it belongs to may yet fail.
            log.warning("redelivered while its first attempt runs here; left to that attempt",
                        extra={"request_id": request.request_id, "attempt": msg.metadata.num_delivered})
            await msg.in_progress()
            return
        if running is not None and running.msg is not None and request.attempt > running.request.attempt:
            # Its requester migrated the request to a newer attempt: the one running here lost.
            # It stops now; the new message comes back once the engine is free of the id.
            log.info("a newer attempt of a request running here; the run here stops",
                     extra={"request_id": request.request_id, "attempt": request.attempt})
            if running.replier is not None:
                running.replier.silence(ErrorCode.ATTEMPT_TAKEN)
            await self.abort(running.request)
            await self._settle(running.msg, running.ref, terminate=True)  # its requester gave that message up
            await msg.nak(delay=liveness.PROBE_S)
            return
        # Another message whose id is already running here: refused, so the running one is untouched.
        log.warning("request id already running here; refused",
                    extra={"request_id": request.request_id, "attempt": msg.metadata.num_delivered})
        if held is None or held.reply_subject != request.reply_subject:
            # Its own requester is told; on the running one's reply subject a frame would only confuse.
            replier = Replier(self.bus.nc, request.reply_subject,
                              liveness.attempt_of(request, msg.metadata.num_delivered), self.bus.node)
            await replier.error(409, ErrorCode.INVALID_REQUEST, "A request with this id is already running.")
        await self._settle(msg, ref, terminate=True)

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
            await self._settle(msg, held.ref, terminate=True)
            await publish_event(self.bus.js, wire.AdmissionDecided(
                model=request.model, node=self.bus.node, request_id=request.request_id,
                principal=request.principal,
                decision=wire.AdmissionDecision.CANCELLED if cancelled else wire.AdmissionDecision.TIMEOUT,
                detail="dropped by the worker: nobody waits for it", pending=len(self.active),
                in_flight=len(self.active),
            ), subject_kind=topology.DROPPED)  # admission events are the gateways' own
            return
        attempt = liveness.attempt_of(request, msg.metadata.num_delivered)
        replier = held.replier = Replier(self.bus.nc, request.reply_subject, attempt, self.bus.node)
        if attempt > 1 and request.liveness_probe and not await liveness.still_wanted(
                self.bus.nc, request.reply_subject, attempt):
            # Another attempt serves its client (or nobody waits any more): this one must not run.
            log.info("redelivered request no longer wanted", extra={"request_id": request.request_id,
                                                                    "attempt": attempt})
            await self._settle(msg, held.ref, terminate=True)
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
        await self._settle(msg, held.ref, terminate=outcome.terminate)

    async def serve_once(self, request: wire.GenerateRequest, replier: Replier) -> wire.RunFinished:
        """One request not pulled from the consumer (the `generate` endpoint), served the same way;
        it takes its slots like any other. Raises ServingError (409) for an id already running here."""
        if self._holds(request):
            raise ServingError(409, ErrorCode.INVALID_REQUEST, "A request with this id is already running.")
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
        self._slot_freed.set()

    def free_slots(self) -> int:
        """Engine sequences not promised to a pulled request (a request takes one per choice)."""
        if self.engine.free_slots() <= 0:
            return 0  # e.g. the engine process is gone
        if self.engine.stats.num_waiting > 0:
            # The engine already holds work it has no KV blocks (or batch room) for: more would
            # only wait here, where another worker might have served it at once.
            return 0
        promised = sum(r.sampling.n for r in self.requests.values()) + self._fetching
        return max(self.engine.max_num_seqs - promised, 0)

    def status(self) -> wire.ModelStatus:
        limits = self.context.derive()
        stats = self.engine.stats
        return wire.ModelStatus(
            model=self.model_id,
            max_model_len=limits.context,
            max_input_tokens=limits.input,
            max_output_tokens=limits.output,
            slots=self.engine.max_num_seqs,
            free_slots=self.free_slots(),
            num_running=stats.num_running,
            num_waiting=stats.num_waiting,
            kv_usage=round(stats.kv_usage, 4),
            prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits,
            state_slots=stats.num_state_slots,
            free_state_slots=stats.num_free_state_slots,
            state=ModelState.POISONED if self.poisoned is not None else ModelState.READY,
            # The node entry (a KV write) carries it: bounded like every error text.
            detail=wire.bounded_text(self.poisoned) if self.poisoned is not None else None,
            prefill_tok_per_s=round(self.context.prefill_tok_per_s, 1),
            memory_mb=self.memory_mb,
            vocab_size=self.tokenizer.vocab_size,
            dtype=self.engine.info.dtype,
            dtype_reason=self.engine.info.dtype_reason,
            grammar_compiles=stats.grammar_compiles + self.model.grammars.started,
            grammar_cache_hits=stats.grammar_cache_hits,
        )

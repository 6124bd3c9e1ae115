"""The worker process: load a model, register in `helexa_nodes`, pull what fits, serve, record.

It fetches from its model's shared durable consumer only as many requests as it has free
slots, so JetStream spreads work across workers by capacity with no router of our own.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.metadata
import logging
import time
from typing import Any

import msgspec
import nats.errors
from nats.aio.msg import Msg

from apps.bus import topology, wire
from apps.logs import announce_ready
from apps.settings import WorkerSettings
from apps.worker import serve
from apps.worker.context_limit import ContextLimit
from apps.worker.prompt import RequestRejected, build_prompt, sampling_options
from apps.worker.replies import Replier
from engine.api import Engine
from engine.tokenizer import Tokenizer

log = logging.getLogger("helexa.worker")
KEEP_ALIVE_S = 5.0
# How often a running request checks that its requester still listens.
PROBE_S = 1.0


def _version() -> str:
    try:
        return importlib.metadata.version("helexa")
    except importlib.metadata.PackageNotFoundError:
        return "dev"


class Worker:
    def __init__(self, settings: WorkerSettings, engine: Engine, tokenizer: Tokenizer, model_id: str) -> None:
        self.settings = settings
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_id = model_id
        self.node = settings.node_id
        self.active: dict[str, asyncio.Task[None]] = {}
        self.requests: dict[str, wire.GenerateRequest] = {}
        # Cancellations for requests not pulled yet; bounded so a flood cannot grow it forever.
        self._cancelled: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._slot_freed = asyncio.Event()
        info = getattr(engine, "info", None)  # engines with a paged pool describe it
        self.context = ContextLimit(
            max_position_embeddings=(info.max_position_embeddings if info else 0) or engine.max_model_len,
            kv_pool_tokens=info.num_blocks * info.block_size if info else None,
            hard_cap=settings.max_model_len or None,
        )

    async def run(self, stop: asyncio.Event) -> None:
        self.nc = await topology.connect(self.settings.nats_url, name=f"helexa-worker-{self.node}")
        self.js = self.nc.jetstream()
        await topology.ensure_topology(self.js)
        self.kv = await topology.node_registry(self.js)
        subscription = await topology.worker_subscription(self.js, self.model_id)
        await self.nc.subscribe(topology.cancel_wildcard(), cb=self._on_cancel)
        await self._publish_status()
        status_task = asyncio.create_task(self._status_loop())
        announce_ready("worker", model=self.model_id, node=self.node, max_model_len=self.context.derive().context)
        try:
            await self._pull_loop(subscription, stop)
        finally:
            status_task.cancel()
            await self._drain()
            try:
                await self.kv.delete(self.node)
            except nats.errors.Error:
                pass
            # drain() waits out pull subscriptions (30 s in nats-py); flush what we sent and close.
            await self.nc.flush()
            await self.nc.close()

    async def _pull_loop(self, subscription: Any, stop: asyncio.Event) -> None:
        stopping = asyncio.create_task(stop.wait())
        while not stop.is_set():
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
                log.warning("fetch failed", extra={"error": str(exc)})
                await asyncio.wait({stopping}, timeout=1.0)
                continue
            for msg in msgs:
                self._start(msg)
        stopping.cancel()

    def _start(self, msg: Msg) -> None:
        try:
            request = wire.request_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable request terminated", extra={"error": str(exc)})
            asyncio.create_task(msg.term())
            return
        task = asyncio.create_task(self._serve(msg, request))
        self.active[request.request_id] = task
        self.requests[request.request_id] = request
        task.add_done_callback(lambda _: self._finished(request.request_id))

    def _finished(self, request_id: str) -> None:
        self.active.pop(request_id, None)
        self.requests.pop(request_id, None)
        self._slot_freed.set()

    async def _serve(self, msg: Msg, request: wire.GenerateRequest) -> None:
        cancelled = request.request_id in self._cancelled
        if cancelled or (request.deadline and time.time() > request.deadline):
            # Its client has already been answered (a 503 or a hang-up): nobody waits for it.
            log.info("dropped request nobody waits for", extra={"request_id": request.request_id})
            await msg.term()
            await self._publish_event(wire.AdmissionDecided(
                model=request.model, node=self.node, request_id=request.request_id, principal=request.principal,
                decision=wire.AdmissionDecision.CANCELLED if cancelled else wire.AdmissionDecision.TIMEOUT,
                detail="dropped by the worker: nobody waits for it", pending=len(self.active),
                in_flight=len(self.active),
            ))
            return
        attempt = msg.metadata.num_delivered or 1
        replier = Replier(self.nc, request.reply_subject, attempt, self.node)
        record = serve.RunRecord(request=request, node=self.node, attempt=attempt, received_at=time.time())
        try:
            prompt = build_prompt(self.tokenizer, request, self.settings.reasoning_parser)
            record.prompt_tokens = len(prompt.token_ids)
            sampling = sampling_options(request, len(prompt.token_ids), self.context.derive().context)
        except RequestRejected as exc:
            await replier.error(exc.status, exc.code, exc.message)
            await msg.ack()
            await self._publish_event(record.finished_event("rejected", "error", exc.code))
            return
        await replier.accepted(len(prompt.token_ids))
        await self._publish_event(record.started_event())
        keep_alive = asyncio.create_task(serve.keep_alive(replier, KEEP_ALIVE_S, msg.in_progress))
        watcher = None
        if request.liveness_probe:
            watcher = asyncio.create_task(
                serve.watch_requester(self.nc, request.reply_subject, PROBE_S, lambda: self._abort(request))
            )
        try:
            reasons, error = await serve.generate(self.engine, self.tokenizer, replier, record, prompt, sampling)
            finish_reason = reasons[0]
        except Exception as exc:  # the run fails, the worker goes on
            log.exception("generation failed", extra={"request_id": request.request_id})
            finish_reason, error = "error", type(exc).__name__
            await self._abort(request)
        finally:
            keep_alive.cancel()
            if watcher is not None:
                watcher.cancel()
        record.finished_at = time.time()
        self.context.observe_prefill(record.prompt_tokens - record.cached_tokens, record.prefill_ms)
        if error is not None:
            await replier.error(500, "generation_failed", "The generation failed on the worker.")
            status = "error"
        else:
            await replier.final(finish_reason, record.usage())
            status = "cancelled" if finish_reason == "abort" else "ok"
        await msg.ack()
        await self._publish_event(record.finished_event(status, finish_reason, error))

    async def _abort(self, request: wire.GenerateRequest) -> None:
        for engine_request_id in serve.engine_request_ids(request.request_id, request.sampling.n):
            await self.engine.abort(engine_request_id)

    async def _on_cancel(self, msg: Msg) -> None:
        request_id = topology.request_id_from_cancel(msg.subject)
        if request_id in self.active:
            log.info("cancelling", extra={"request_id": request_id})
            await self._abort(self.requests[request_id])
        else:
            self._cancelled[request_id] = None
            while len(self._cancelled) > 10_000:
                self._cancelled.popitem(last=False)

    async def _publish_event(self, event: wire.AnyEvent) -> None:
        kind = wire.event_kind(event)
        try:
            await self.js.publish(
                topology.event_subject(kind, event.model), wire.encode(event), headers={"Nats-Msg-Id": event.event_id}
            )
        except nats.errors.Error as exc:
            log.warning("event publish failed", extra={"kind": kind, "request_id": getattr(event, "request_id", None),
                                                           "error": str(exc)})

    def free_slots(self) -> int:
        """Engine sequences not promised to a pulled request (a request takes one per choice)."""
        if self.engine.free_slots() <= 0:
            return 0  # e.g. the engine process is gone
        stats = getattr(self.engine, "stats", None)
        if stats is not None and stats.num_waiting > 0:
            # The engine already holds work it has no KV blocks (or batch room) for: more would
            # only wait here, where another worker might have served it at once.
            return 0
        return max(self.engine.max_num_seqs - sum(r.sampling.n for r in self.requests.values()), 0)

    def status(self, state: str = "ready") -> wire.NodeStatus:
        slots = self.engine.max_num_seqs
        limits = self.context.derive()
        stats = getattr(self.engine, "stats", None)  # engines without a KV pool report none
        model = wire.ModelStatus(
            model=self.model_id,
            max_model_len=limits.context,
            max_input_tokens=limits.input,
            max_output_tokens=limits.output,
            slots=slots,
            free_slots=self.free_slots(),
            num_running=stats.num_running if stats else 0,
            num_waiting=stats.num_waiting if stats else 0,
            kv_usage=round(stats.kv_usage, 4) if stats else 0.0,
            prefix_queries=stats.prefix_queries if stats else 0,
            prefix_hits=stats.prefix_hits if stats else 0,
            state_slots=stats.num_state_slots if stats else 0,
            free_state_slots=stats.num_free_state_slots if stats else 0,
        )
        return wire.NodeStatus(node=self.node, models=[model], version=_version(), status=state)

    async def _publish_status(self, state: str = "ready") -> None:
        await self.kv.put(self.node, wire.encode(self.status(state)))

    async def _status_loop(self) -> None:
        while True:
            await asyncio.sleep(self.settings.status_interval_s)
            try:
                await self._publish_status()
            except Exception as exc:  # a missed refresh must never end the loop: the node would vanish
                log.warning("status publish failed", extra={"error": repr(exc)})

    async def _drain(self, grace_s: float = 10.0) -> None:
        """On shutdown: let running requests finish briefly, then abort the rest."""
        if self.active:
            await asyncio.wait(set(self.active.values()), timeout=grace_s)
        for request in list(self.requests.values()):
            await self._abort(request)
        if self.active:
            await asyncio.wait(set(self.active.values()), timeout=5.0)
        await self.engine.shutdown()

"""One model on one worker: pull what fits from the model's shared consumer, serve, record.

It fetches only as many requests as it has free slots, so JetStream spreads work across the
workers of a model by capacity with no router of our own. A held request is touched (heartbeat
frame + in-progress ack) every heartbeat, so a dead worker's requests go to another worker
after the consumer's short ack wait, and at most max_deliver times.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import msgspec
import nats.errors
from nats.aio.msg import Msg

from apps.bus import topology, wire
from apps.bus.codes import ErrorCode, FinishReason, ModelState, RunStatus, ServingError
from apps.settings import WorkerSettings
from apps.worker import serve
from apps.worker.context_limit import ContextLimit
from apps.worker.prompt import build_prompt, resolve_sampling
from apps.worker.replies import Replier
from engine.protocol import DeviceFault, Engine, is_device_fault
from engine.tokenizer import Tokenizer

log = logging.getLogger("helexa.worker")
# How often a running request checks that its requester still listens.
PROBE_S = 1.0


class Host(Protocol):
    """What a model server needs from its worker: the bus and the node-wide cancellations."""

    node: str
    nc: Any
    js: Any

    def was_cancelled(self, request_id: str) -> bool: ...

    async def publish_event(self, event: wire.AnyEvent) -> None: ...

    async def publish_status(self) -> None: ...


def poisoned_message(model: str) -> str:
    return (f"The model '{model}' hit a device fault on this worker and is out of service; "
            f"reload it (helexa models load {model}).")


class CollectingReplier(Replier):
    """Frames kept in memory: for the request-reply `generate` endpoint, which answers once."""

    def __init__(self, attempt: int, node: str) -> None:
        super().__init__(None, "", attempt, node)  # type: ignore[arg-type]
        self.frames: list[wire.ReplyFrame] = []

    async def _send(self, frame: wire.ReplyFrame) -> None:
        self._seq += 1
        self.frames.append(frame)


class ModelServer:
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
        self.poisoned: str | None = None
        self._slot_freed = asyncio.Event()
        self._stop = asyncio.Event()
        self._pulling: asyncio.Task[None] | None = None
        info = engine.info
        self.context = ContextLimit(
            max_position_embeddings=info.max_position_embeddings or engine.max_model_len,
            # Engines without a paged pool (the scripted one) report no blocks: no KV ceiling.
            kv_pool_tokens=info.num_blocks * info.block_size or None,
            hard_cap=settings.max_model_len or None,
        )

    async def start(self, host: Host, limits: topology.BusLimits) -> None:
        self.host = host
        subscription = await topology.worker_subscription(host.js, self.model_id, limits)
        self._pulling = asyncio.create_task(self._pull_loop(subscription))

    async def stop(self, grace_s: float = 10.0) -> None:
        """Pull nothing more, let running requests finish briefly, abort the rest, free the engine."""
        self._stop.set()
        if self._pulling is not None:
            await self._pulling
        if self.active:
            await asyncio.wait(set(self.active.values()), timeout=grace_s)
        for request in list(self.requests.values()):
            await self.abort(request)
        if self.active:
            await asyncio.wait(set(self.active.values()), timeout=5.0)
        await self.engine.shutdown()

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
        cancelled = self.host.was_cancelled(request.request_id)
        if cancelled or (request.deadline and time.time() > request.deadline):
            # Its client has already been answered (a 503 or a hang-up): nobody waits for it.
            log.info("dropped request nobody waits for", extra={"request_id": request.request_id})
            await msg.term()
            await self.host.publish_event(wire.AdmissionDecided(
                model=request.model, node=self.host.node, request_id=request.request_id,
                principal=request.principal,
                decision=wire.AdmissionDecision.CANCELLED if cancelled else wire.AdmissionDecision.TIMEOUT,
                detail="dropped by the worker: nobody waits for it", pending=len(self.active),
                in_flight=len(self.active),
            ))
            return
        attempt = msg.metadata.num_delivered or 1
        if attempt > 1 and request.liveness_probe and not await self._still_wanted(request, attempt):
            # Its worker died after sending text: the client has had an error, this must not run.
            log.info("redelivered request no longer wanted", extra={"request_id": request.request_id,
                                                                    "attempt": attempt})
            await msg.term()
            return
        replier = Replier(self.host.nc, request.reply_subject, attempt, self.host.node)
        keep_alive = asyncio.create_task(serve.keep_alive(replier, self.settings.heartbeat_s, msg.in_progress))
        try:
            record = await self.run(request, replier, attempt, probe=request.liveness_probe)
        finally:
            keep_alive.cancel()
        await msg.ack()
        await self.host.publish_event(record)

    async def _still_wanted(self, request: wire.GenerateRequest, attempt: int) -> bool:
        """Ask the requester whether this attempt may run (another may have sent text already)."""
        try:
            answer = await self.host.nc.request(topology.alive_subject(request.reply_subject),
                                                str(attempt).encode(), timeout=2.0)
        except nats.errors.NoRespondersError:
            return False  # the requester is gone
        except (TimeoutError, nats.errors.Error):
            return True  # slow is not gone
        return answer.data != topology.ATTEMPT_TAKEN

    async def run(self, request: wire.GenerateRequest, replier: Replier, attempt: int,
                  probe: bool = False) -> wire.RunFinished:
        """Serve one request through `replier` and return the run's outcome for the ledger."""
        record = serve.RunRecord(request=request, node=self.host.node, attempt=attempt, received_at=time.time())
        if self.poisoned is not None:
            await replier.error(503, ErrorCode.MODEL_POISONED, poisoned_message(self.model_id))
            return record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, ErrorCode.MODEL_POISONED)
        try:
            prompt = build_prompt(self.tokenizer, request, self.settings.reasoning_parser)
            record.prompt_tokens = len(prompt.token_ids)
            sampling = resolve_sampling(request, len(prompt.token_ids), self.context.derive().context)
        except ServingError as exc:
            await replier.error(exc.status, exc.code, exc.message)
            return record.finished_event(RunStatus.REJECTED, FinishReason.ERROR, exc.code)
        await replier.accepted(len(prompt.token_ids))
        await self.host.publish_event(record.started_event())
        watcher = None
        if probe:
            watcher = asyncio.create_task(
                serve.watch_requester(self.host.nc, request.reply_subject, PROBE_S, lambda: self.abort(request))
            )
        try:
            reasons, error = await serve.generate(self.engine, self.tokenizer, replier, record, prompt, sampling)
            finish_reason = reasons[0]
            if is_device_fault(error):
                self._poison(error or "device fault")
                error = ErrorCode.DEVICE_FAULT
        except DeviceFault as exc:
            self._poison(str(exc) or "device fault")
            finish_reason, error = FinishReason.ERROR, ErrorCode.DEVICE_FAULT
            await self.abort(request)
        except Exception as exc:  # the run fails, the worker goes on
            log.exception("generation failed", extra={"request_id": request.request_id})
            finish_reason, error = FinishReason.ERROR, type(exc).__name__
            await self.abort(request)
        finally:
            if watcher is not None:
                watcher.cancel()
        record.finished_at = time.time()
        self.context.observe_prefill(record.prompt_tokens - record.cached_tokens, record.prefill_ms)
        if error == ErrorCode.DEVICE_FAULT:
            await replier.error(503, ErrorCode.MODEL_POISONED, poisoned_message(self.model_id))
            return record.finished_event(RunStatus.ERROR, finish_reason, error)
        if error is not None:
            await replier.error(500, ErrorCode.GENERATION_FAILED, "The generation failed on the worker.")
            return record.finished_event(RunStatus.ERROR, finish_reason, error)
        await replier.final(finish_reason, record.usage())
        status = RunStatus.CANCELLED if finish_reason == FinishReason.ABORT else RunStatus.OK
        return record.finished_event(status, finish_reason)

    def _poison(self, detail: str) -> None:
        """Out of service until reloaded: the device's state can no longer be trusted."""
        if self.poisoned is None:
            log.error("device fault: model poisoned", extra={"model": self.model_id, "error": detail})
            self.poisoned = detail
            asyncio.create_task(self.host.publish_status())  # tell gateways now, not at the next refresh

    async def abort(self, request: wire.GenerateRequest) -> None:
        for engine_request_id in serve.engine_request_ids(request.request_id, request.sampling.n):
            await self.engine.abort(engine_request_id)

    def free_slots(self) -> int:
        """Engine sequences not promised to a pulled request (a request takes one per choice)."""
        if self.engine.free_slots() <= 0:
            return 0  # e.g. the engine process is gone
        if self.engine.stats.num_waiting > 0:
            # The engine already holds work it has no KV blocks (or batch room) for: more would
            # only wait here, where another worker might have served it at once.
            return 0
        return max(self.engine.max_num_seqs - sum(r.sampling.n for r in self.requests.values()), 0)

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
            detail=self.poisoned,
            prefill_tok_per_s=round(self.context.prefill_tok_per_s, 1),
            memory_mb=self.memory_mb,
            vocab_size=self.tokenizer.vocab_size,
            dtype=self.engine.info.dtype,
        )

"""Worker intake (runs in the worker process): the step between JetStream and a model's serving loop.

It pulls from the model's shared consumers (through `apps.bus.pull.BatchPuller`, as the recorder
does) only as many messages as the loop has free slots, so JetStream spreads work across the
workers of a model by capacity with no router of our own. There is one consumer per service class
(`topology.worker_consumer`): interactive requests are pulled into every free slot, batch-class
ones (the batch runner's lines) only into the free slots beyond a reserve kept for interactive
work (`interactive_reserve`), so a worker full of batch lines still takes an interactive request
at once; the engine's scheduler then preempts batch sequences for it where it must.

It decodes each message, fetches a body too large for its message from the Object Store, and hands
the loop (`ModelLoop`) each request it may serve as a `Held`. It settles messages for good (ack,
or term with the large body deleted) and hands them back (nak) when the worker stops.

The engine never sees a request id twice: a redelivery of a message still running here is left to
its run, a newer attempt of a request running here (its requester migrated it) takes over from the
run here, which lost, and any other message reusing a running id is refused alone (409, terminated). A request
whose reply subject the server would refuse is terminated unanswered, since publishing on it would
cost this worker its connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from apps.bus import large_requests, topology, wire
from apps.bus.codes import ErrorCode
from apps.bus.pull import BatchPuller
from apps.worker import liveness
from apps.worker.choices import engine_request_ids
from apps.worker.replies import Replier
from apps.worker.run import abort_request
from engine.frontend.protocol import Engine, ServiceClass

log = logging.getLogger("helexa.worker")

# How long one wait for the first message of a class lasts (the server answers 408 at its end):
# an idle worker asks once per wait and class. Nothing waits one out (`BatchPuller.interrupt` on a
# reconnect, `stop` when the worker stops), but while one lasts, a worker that freezes (SIGSTOP,
# a hung process) still has the server hand it the next request, which then waits for a
# migration or its ack wait: interactive waits stay short for that, batch lines may wait.
IDLE_WAIT_S = {ServiceClass.INTERACTIVE: 1.0, ServiceClass.BATCH: 10.0}


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


def interactive_reserve(setting: int, max_num_seqs: int) -> int:
    """Slots batch-class requests are never pulled into: `setting` (HELEXA_INTERACTIVE_RESERVE), or
    when it is negative a quarter of `max_num_seqs`, at least 1; never every slot (an engine of one
    sequence keeps none: batch lines would never run there)."""
    reserve = max(1, max_num_seqs // 4) if setting < 0 else setting
    return max(min(reserve, max_num_seqs - 1), 0)


# How long a newer attempt waits here for the older attempt it replaces to end.
RELEASE_WAIT_S = 30.0


def holds(held: Mapping[str, Held], request: wire.GenerateRequest) -> bool:
    """Whether one of `request`'s engine ids is already running here: the engine core must never
    see an id twice (it cannot tell the two apart and fails)."""
    running = {rid for h in held.values() for rid in engine_request_ids(h.request.request_id, h.request.sampling.n)}
    return any(rid in running for rid in engine_request_ids(request.request_id, request.sampling.n))


class Intake:
    """One model's messages: pulled while `free_slots(service_class)` has room, each request it may serve handed
    to `begin`. `held` is the loop's table of what it holds (read here to refuse duplicates)."""

    def __init__(self, model_id: str, engine: Engine, held: Mapping[str, Held], reserve: int = 0) -> None:
        self.model_id = model_id
        self.engine = engine
        self.held = held
        # Free slots batch-class requests are not pulled into (`interactive_reserve`).
        self.reserve = reserve
        # Requests pulled since the start, by class (the node status carries them to /metrics).
        self.pulled = dict.fromkeys(ServiceClass, 0)
        # Large requests whose body is being fetched from the Object Store (each takes a slot).
        self.fetching = 0
        self._slot_freed = asyncio.Event()
        # Newer attempts waiting for an older one of theirs to let go of its id (`wake` tells them).
        self._release_waiters: set[asyncio.Event] = set()
        self._stop = asyncio.Event()
        self._pulling: asyncio.Task[None] | None = None

    async def start(self, bus: NodeBus, free_slots: Callable[[ServiceClass], int],
                    begin: Callable[[Held], None]) -> None:
        self.bus = bus
        self._free_slots = free_slots
        self._begin_run = begin
        pullers = {cls: await topology.worker_puller(bus.nc, self.model_id, bus.limits, cls) for cls in ServiceClass}
        self._pulling = asyncio.create_task(self._pull_loop(pullers))

    async def stop(self) -> None:
        """Pull nothing more (and begin nothing that waits: `_begin_when_released`)."""
        self._stop.set()
        self.wake()
        if self._pulling is not None:
            await self._pulling

    def wake(self) -> None:
        """Look for requests again now (a slot was freed, or the engine has slots again)."""
        self._slot_freed.set()
        for waiter in self._release_waiters:
            waiter.set()

    def room(self, cls: ServiceClass) -> int:
        """Sequences a request of `cls` may start on now, pulled or not (the `generate` endpoint):
        the free slots, less the interactive reserve for batch-class work."""
        if cls == ServiceClass.INTERACTIVE:
            return self._free_slots(cls)
        return self._free_slots(cls) - self.reserve

    def _room(self, cls: ServiceClass, waits: Mapping[ServiceClass, object]) -> int:
        """Messages of `cls` that may be pulled now. A wait under way may bring one message, so it
        holds a slot until it ends, for batch-class requests. Interactive requests do not count it:
        the seat a batch wait might fill is one the scheduler preempts for them (counting it kept
        the last interactive request of a full worker in the stream until the batch wait expired)."""
        if cls == ServiceClass.INTERACTIVE:
            return self.room(cls)
        return self.room(cls) - len(waits)

    async def _pull_loop(self, pullers: Mapping[ServiceClass, BatchPuller]) -> None:
        """Take what is ready, interactive first; when nothing is, wait for the first message of
        either class (one wait per class, each for one message) or for a slot to free."""
        stopping = asyncio.create_task(self._stop.wait())
        waits: dict[ServiceClass, asyncio.Task[list[Msg]]] = {}
        try:
            while not self._stop.is_set():
                # Cleared before the slots are counted, so a slot freed from here on wakes the wait below.
                self._slot_freed.clear()
                # Classes whose wait just ended on the server's "nothing came": asking again at once
                # whether anything is there would only cost a pull; the next wait asks.
                found_nothing = set()
                for cls, task in list(waits.items()):
                    if task.done():
                        del waits[cls]
                        msgs = self._waited(task)
                        self._start_all(cls, msgs)
                        if not msgs and task.exception() is None:
                            found_nothing.add(cls)
                took, failed = 0, False
                for cls in ServiceClass:  # interactive first
                    room = 0 if cls in waits else self._room(cls, waits)
                    if room <= 0 or cls in found_nothing:
                        continue
                    try:
                        msgs = await pullers[cls].take_ready(room)
                    except nats.errors.Error as exc:
                        log.warning("fetch failed", extra={"model": self.model_id, "error": str(exc)})
                        msgs, failed = [], True
                    self._start_all(cls, msgs)
                    took += len(msgs)
                if failed:
                    await asyncio.wait({stopping}, timeout=1.0)
                if took or failed:
                    continue
                for cls in ServiceClass:
                    if cls not in waits and self._room(cls, waits) > 0:
                        waits[cls] = asyncio.create_task(pullers[cls].fetch(1, timeout=IDLE_WAIT_S[cls]))
                freed = asyncio.create_task(self._slot_freed.wait())
                await asyncio.wait({*waits.values(), freed, stopping}, return_when=asyncio.FIRST_COMPLETED)
                freed.cancel()
        finally:
            stopping.cancel()
            # Every wait ends now; what came in it, or after it before the inbox closed, goes back.
            came: list[Msg] = []
            for puller in pullers.values():
                came += await puller.stop()
            for task in waits.values():
                await asyncio.wait({task})
                came += self._waited(task)
            for msg in came:
                with contextlib.suppress(nats.errors.Error):
                    await msg.nak()

    def _waited(self, task: asyncio.Task[list[Msg]]) -> list[Msg]:
        """What a finished wait brought ([] when its fetch failed: the loop asks again)."""
        try:
            return task.result()
        except nats.errors.Error as exc:
            log.warning("fetch failed", extra={"model": self.model_id, "error": str(exc)})
            return []

    def _start_all(self, cls: ServiceClass, msgs: list[Msg]) -> None:
        self.pulled[cls] += len(msgs)
        for msg in msgs:
            try:
                self._start(msg)
            except Exception:  # a bug: this message ends here, the pull loop and the others go on
                log.exception("a request could not be started; terminated", extra={"model": self.model_id})
                asyncio.create_task(msg.term())

    def _start(self, msg: Msg) -> None:
        try:
            body = wire.decode_request(msg.data)
        except msgspec.DecodeError as exc:
            log.warning("undecodable request terminated", extra={"error": str(exc)})
            asyncio.create_task(msg.term())
            return
        if isinstance(body, wire.RequestRef):
            self.fetching += 1  # it takes its slot while its body comes
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
            await self.settle(msg, ref, terminate=True)
            return
        except (nats.errors.Error, TimeoutError) as exc:
            # The bus is unwell: another delivery (here or elsewhere) tries again.
            log.warning("large request not fetched; left for redelivery",
                        extra={"request_id": ref.request_id, "error": repr(exc)})
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=1.0)
            return
        finally:
            self.fetching -= 1
            self._slot_freed.set()
        self._begin(msg, request, ref)

    def _begin(self, msg: Msg, request: wire.GenerateRequest, ref: wire.RequestRef | None = None) -> None:
        if request.model != self.model_id:
            # This consumer delivers only this model's subject, which a gateway names for the
            # request's own model: anything else was not put there by a gateway.
            log.warning("request for another model on this model's consumer terminated",
                        extra={"request_id": request.request_id, "model": self.model_id})
            asyncio.create_task(self.settle(msg, ref, terminate=True))
            return
        if not topology.valid_reply_subject(request.reply_subject):
            # Publishing on it could make the server close this worker's connection for good.
            log.warning("request with an unusable reply subject terminated",
                        extra={"request_id": request.request_id, "bytes": len(request.reply_subject.encode())})
            asyncio.create_task(self.settle(msg, ref, terminate=True))
            return
        if holds(self.held, request):
            asyncio.create_task(self._refuse_duplicate(msg, request, ref))
            return
        self._begin_run(Held(request, msg, ref=ref))

    async def _begin_when_released(self, msg: Msg, request: wire.GenerateRequest,
                                   ref: wire.RequestRef | None) -> None:
        """The newer attempt of a request whose older attempt is stopping here: kept here (alive
        with in-progress acks) until the engine is free of the id, then begun. A nak would spend one
        of its deliveries each time the older run had not ended yet, and a slow end would use them
        all up. It goes back for redelivery after all (one delivery) when the older run has not
        ended within RELEASE_WAIT_S, or when this worker stops meanwhile."""
        waiter = asyncio.Event()
        self._release_waiters.add(waiter)
        try:
            async with asyncio.timeout(RELEASE_WAIT_S):
                while holds(self.held, request) and not self._stop.is_set():
                    waiter.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(waiter.wait(), liveness.PROBE_S)
                    await msg.in_progress()
            if self._stop.is_set():
                raise TimeoutError("the worker is stopping")
        except (TimeoutError, nats.errors.Error) as exc:
            log.warning("a newer attempt not begun here; handed back",
                        extra={"request_id": request.request_id, "error": repr(exc)})
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=liveness.PROBE_S)
            return
        except asyncio.CancelledError:
            with contextlib.suppress(nats.errors.Error):
                await asyncio.shield(msg.nak())
            raise
        finally:
            self._release_waiters.discard(waiter)
        self._begin(msg, request, ref)

    async def settle(self, msg: Msg, ref: wire.RequestRef | None, *, terminate: bool) -> None:
        """Ack (or terminate) a message for good; a large request's object goes with it."""
        await (msg.term() if terminate else msg.ack())
        if ref is not None:
            await large_requests.delete(self.bus.js, ref)

    async def hand_back(self, held: Held) -> None:
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
        await abort_request(self.engine, held.request)

    async def _refuse_duplicate(self, msg: Msg, request: wire.GenerateRequest,
                                ref: wire.RequestRef | None = None) -> None:
        running = self.held.get(request.request_id)
        if running is None and not holds(self.held, request):
            # The run that held the id ended between `_begin`'s check and this task (a migrated
            # attempt arriving as its engine-lost run settles): nothing to refuse any more, so the
            # message goes back and is served as any other.
            log.info("a duplicate's run ended meanwhile; handed back to be served",
                     extra={"request_id": request.request_id})
            await msg.nak()
            return
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
            await abort_request(self.engine, running.request)
            await self.settle(running.msg, running.ref, terminate=True)  # its requester gave that message up
            await self._begin_when_released(msg, request, ref)
            return
        # Another message whose id is already running here: refused, so the running one is untouched.
        log.warning("request id already running here; refused",
                    extra={"request_id": request.request_id, "attempt": msg.metadata.num_delivered})
        if held is None or held.reply_subject != request.reply_subject:
            # Its own requester is told; on the running one's reply subject a frame would only confuse.
            replier = Replier(self.bus.nc, request.reply_subject,
                              liveness.attempt_of(request, msg.metadata.num_delivered), self.bus.node)
            await replier.error(409, ErrorCode.INVALID_REQUEST, "A request with this id is already running.")
        await self.settle(msg, ref, terminate=True)

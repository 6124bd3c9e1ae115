"""Events onto EVENTS: never lost in silence, by reference when too large, and several of one
subject to a message when they come together.

Serving never fails for the ledger's sake. An event EVENTS does not take now (full, or the bus
unreachable) is held by this process and published again in the background until it is stored
(`held_events` counts them), so nothing is dropped in silence; once a process has called
`keep_held_on_disk` for a role, each held event of that role's subjects is also written to the
role's spool (`apps.bus.held_spool`) until stored, and the next process of that role publishes what
a process that died still held (past `MAX_HELD_EVENTS` at once, the rest as held ones are stored).
One too large for a message goes through the Object Store as an `EventRef`.

Batches. Every request makes two to four events (its admission, its run's start and finish,
preemptions), so a node serving many streams sends many a second, and each message costs a
publish, a PubAck, a delivery and an ack in the publisher, the NATS server and the recorder. An
event of a `BATCHED_KINDS` kind waits up to `BATCH_WINDOW_S` for the others its process publishes
on the same subject and connection, and they go as one message, a JSON array
(`apps.bus.events.event_parts`), of at most `BATCH_MAX_EVENTS` events and the server's
max_payload. Its `Nats-Msg-Id` is the first event's id and the count, so a retried batch is
stored once. The publisher's await ends when its message is stored, as before, so an order such
as "the run's event, then the request's ack" still holds. A batch EVENTS does not take is held
event by event. The events of one message are recorded and settled together (`apps.recorder.parts`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from apps.bus import roles, topology, wire
from apps.bus.events import BATCHED_KINDS, AnyEvent, EventRef, batch_body, event_kind
from apps.bus.held_spool import HeldSpool
from apps.bus.object_streams import put_options
from apps.bus.publish import StreamFull, client_of, fits, is_stream_full, message_size, publish

log = logging.getLogger("helexa.bus")

# Events this process holds at most while EVENTS refuses them; past it one more is logged as lost.
MAX_HELD_EVENTS = 10_000
_HELD_RETRY_S = (0.5, 5.0)
# How long an event waits for others to share its message: the ledger is written a few ms later,
# no client waits for it.
BATCH_WINDOW_S = 0.01
BATCH_MAX_EVENTS = 256
# The header a batch is published with, at its longest (a 32-digit id, `+` and the count).
_BATCH_HEADER_BYTES = message_size(b"", {"Nats-Msg-Id": "0" * 32 + f"+{BATCH_MAX_EVENTS}"})

_held: set[asyncio.Task[None]] = set()
# Each event loop's spools of held events, by role, once its process asked for them.
_spools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, HeldSpool]] = weakref.WeakKeyDictionary()
# Each loop's events found in a spool while `MAX_HELD_EVENTS` were held: each is held in its turn,
# as a held one is stored.
_from_spool: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, deque[_Held]] = weakref.WeakKeyDictionary()
# Events refused while `MAX_HELD_EVENTS` were held, being written to their role's spool.
_spooling: set[asyncio.Task[None]] = set()


def held_events() -> int:
    """Events this process holds because EVENTS did not take them yet (those a spool had no turn
    for yet too)."""
    return len(_held) + len(_spooling) + sum(len(waiting) for waiting in _from_spool.values())


async def publish_event(js: JetStreamContext, event: AnyEvent, *, required: bool = False,
                        on_full: Callable[[], None] | None = None,
                        current: Callable[[], JetStreamContext] | None = None,
                        subject_kind: str | None = None) -> bool:
    """Put one event on EVENTS under `helexa.events.<kind>.<model>`, keyed by its event id; under
    `subject_kind` instead of its own kind when its role reports it on another's behalf
    (`topology.WORKER_LOST`, `topology.DROPPED`: see `apps.bus.roles`). A `BATCHED_KINDS` event
    shares its message with the others of its subject that come within `BATCH_WINDOW_S`.

    An event EVENTS does not take now (full, or the bus unreachable) is held and published again
    in the background until it is stored, and False is returned; `on_full` hears that EVENTS was
    full, and `current` (for an app that replaces its connection) gives the context to publish
    the held event on later. `required` (the bench, whose results exist to be recorded) raises
    instead, and is never batched.
    """
    kind = subject_kind or event_kind(event)
    subject = topology.event_subject(kind, event.model)
    if not required and kind in BATCHED_KINDS:
        loop = asyncio.get_running_loop()
        waiting = _Waiting(event, wire.encode(event), loop.create_future(), on_full, current)
        _batches_of(loop).add(js, subject, waiting)
        # A caller cancelled meanwhile leaves its event to go out all the same.
        return await waiting.stored
    try:
        await _publish_event_once(js, subject, event)
    except (nats.errors.Error, TimeoutError) as exc:
        if required:
            raise
        if is_stream_full(exc) and on_full is not None:
            on_full()
        _hold(current or (lambda: js), subject, event, exc)
        return False
    return True


@dataclass(slots=True)
class _Waiting:
    """An event waiting for its batch's message; `stored` says whether EVENTS took it."""

    event: AnyEvent
    body: bytes
    stored: asyncio.Future[bool]
    on_full: Callable[[], None] | None
    current: Callable[[], JetStreamContext] | None


class _Batches:
    """One event loop's events waiting for their messages, by connection and subject."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiting: dict[tuple[int, str], tuple[JetStreamContext, list[_Waiting]]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._sending: set[asyncio.Task[None]] = set()

    def add(self, js: JetStreamContext, subject: str, waiting: _Waiting) -> None:
        key = (id(client_of(js)), subject)
        if key in self._waiting:
            self._waiting[key][1].append(waiting)
        else:
            self._waiting[key] = (js, [waiting])
        if self._timer is None:
            self._timer = self._loop.call_later(BATCH_WINDOW_S, self._flush)

    def _flush(self) -> None:
        self._timer = None
        batches, self._waiting = self._waiting, {}
        for (_, subject), (js, waiting) in batches.items():
            task = self._loop.create_task(_send(js, subject, waiting))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)


_batches: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batches] = weakref.WeakKeyDictionary()


def _batches_of(loop: asyncio.AbstractEventLoop) -> _Batches:
    if loop not in _batches:
        _batches[loop] = _Batches(loop)
    return _batches[loop]


async def _send(js: JetStreamContext, subject: str, waiting: list[_Waiting]) -> None:
    """The waiting events of one subject, in as few messages as the limits allow."""
    for chunk in _chunks(js, waiting):
        first = chunk[0].event
        if len(chunk) == 1:
            await _settle(js, subject, chunk, _publish_event_once(js, subject, first, chunk[0].body))
            continue
        body = batch_body([w.body for w in chunk])
        await _settle(js, subject, chunk, publish(js, subject, body, f"{first.event_id}+{len(chunk)}"))


def _chunks(js: JetStreamContext, waiting: list[_Waiting]) -> Iterator[list[_Waiting]]:
    """`waiting` in runs that each fit one message (an event too large alone is a run of its own:
    it goes by reference)."""
    limit = client_of(js).max_payload - _BATCH_HEADER_BYTES
    chunk: list[_Waiting] = []
    size = 2  # the array's brackets
    for w in waiting:
        grown = size + len(w.body) + (1 if chunk else 0)
        if chunk and (len(chunk) == BATCH_MAX_EVENTS or grown > limit):
            yield chunk
            chunk, grown = [], 2 + len(w.body)
        chunk.append(w)
        size = grown
    if chunk:
        yield chunk


async def _settle(js: JetStreamContext, subject: str, chunk: list[_Waiting], sending: Awaitable[object]) -> None:
    """Publish one message and tell its events' publishers; a message EVENTS does not take
    leaves each of its events held (published again one by one)."""
    try:
        await sending
    except (nats.errors.Error, TimeoutError) as exc:
        if is_stream_full(exc):
            for on_full in {id(w.on_full): w.on_full for w in chunk if w.on_full is not None}.values():
                on_full()
        for w in chunk:
            _hold(w.current or (lambda: js), subject, w.event, exc)
            _tell(w, False)
        return
    except asyncio.CancelledError:  # the loop is closing: nobody is left to hear it
        for w in chunk:
            w.stored.cancel()
        raise
    except Exception as exc:  # a bug: the publishers hear it rather than wait forever
        for w in chunk:
            if not w.stored.done():
                w.stored.set_exception(exc)
        raise
    for w in chunk:
        _tell(w, True)


def _tell(waiting: _Waiting, stored: bool) -> None:
    if not waiting.stored.done():
        waiting.stored.set_result(stored)


async def _publish_event_once(js: JetStreamContext, subject: str, event: AnyEvent, body: bytes | None = None) -> None:
    body = wire.encode(event) if body is None else body
    if fits(client_of(js), body, {"Nats-Msg-Id": event.event_id}):
        await publish(js, subject, body, event.event_id)
        return
    # By reference: the object is named by the event id, so a retry replaces it and is stored once.
    store = await js.object_store(topology.LARGE_EVENTS_BUCKET)
    try:
        await store.put(event.event_id, body, put_options(client_of(js), event.event_id))
    except nats.js.errors.APIError as exc:
        if is_stream_full(exc):
            raise StreamFull(topology.LARGE_EVENTS_BUCKET, exc.description or "") from exc
        raise
    ref = EventRef(event_id=event.event_id, ts=event.ts, model=event.model, node=event.node,
                        ref_kind=event_kind(event), object=event.event_id, size=len(body),
                        digest=hashlib.sha256(body).hexdigest())
    await publish(js, subject, wire.encode(ref), event.event_id)


async def keep_held_on_disk(js: JetStreamContext, data_dir: Path, role: str,
                            current: Callable[[], JetStreamContext] | None = None) -> None:
    """From now on this process keeps the events it holds in `data_dir`'s spool for `role` too,
    and publishes those an earlier process of its role left there (held as any refused event,
    until stored). Waits for the bus while EVENTS cannot be read."""
    while True:
        try:
            info = await (current or (lambda: js))().stream_info(topology.EVENTS_STREAM)
            break
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("cannot read EVENTS to find the held-event spool; retrying", extra={"error": repr(exc)})
            await asyncio.sleep(_HELD_RETRY_S[1])
    stream = hashlib.sha256(f"{topology.EVENTS_STREAM} {info.created}".encode()).hexdigest()[:16]
    spool = HeldSpool(data_dir / "held-events" / stream / role)
    found = await asyncio.to_thread(spool.load)
    _spools.setdefault(asyncio.get_running_loop(), {})[role] = spool
    for subject, event in found:
        _hold(current or (lambda: js), subject, event, None, spooled=spool)
    if found:
        log.warning("publishing events an earlier process held", extra={"held": len(found),
                                                                       "spool": str(spool.folder)})


def _hold(js: Callable[[], JetStreamContext], subject: str, event: AnyEvent, exc: BaseException | None,
          spooled: HeldSpool | None = None) -> None:
    context = {"kind": event_kind(event), "event_id": event.event_id,
               "request_id": getattr(event, "request_id", None), "error": wire.bounded_text(repr(exc))}
    if len(_held) >= MAX_HELD_EVENTS:
        loop = asyncio.get_running_loop()
        if spooled is not None:  # on disk already: its turn comes as held events are stored
            _from_spool.setdefault(loop, deque()).append(_Held(js, subject, event, spooled))
        elif (spool := _spool_for(subject)) is not None:
            # Its role's spool may have room: on disk, it waits its turn as those do.
            writing = asyncio.ensure_future(_spool_past_the_cap(_Held(js, subject, event, spool), context))
            _spooling.add(writing)
            writing.add_done_callback(_spooling.discard)
        else:
            log.error("event lost: too many events already held for EVENTS", extra={**context, "held": len(_held)})
        return
    if exc is not None:
        log.warning("event held until EVENTS takes it", extra={**context, "held": len(_held) + 1})
    task = asyncio.ensure_future(_publish_held(js, subject, event, spooled))
    _held.add(task)
    task.add_done_callback(_stored)


def _spool_for(subject: str) -> HeldSpool | None:
    """This loop's spool of the role that publishes on `subject`, if its process keeps one."""
    return _spools.get(asyncio.get_running_loop(), {}).get(roles.event_publisher(subject) or "")


@dataclass(slots=True, frozen=True)
class _Held:
    js: Callable[[], JetStreamContext]
    subject: str
    event: AnyEvent
    spooled: HeldSpool


async def _spool_past_the_cap(held: _Held, context: dict[str, object]) -> None:
    if await asyncio.to_thread(held.spooled.write, held.subject, held.event):
        _from_spool.setdefault(asyncio.get_running_loop(), deque()).append(held)
        if len(_held) < MAX_HELD_EVENTS:  # a turn came while it was written
            _stored_turn(asyncio.get_running_loop())
    else:
        log.error("event lost: too many events already held for EVENTS, and no room in the spool",
                  extra={**context, "held": len(_held)})


def _stored(task: asyncio.Task[None]) -> None:
    """A held event is stored (or its loop ended): the next one a spool had no room for is held."""
    _held.discard(task)
    if not task.cancelled():
        _stored_turn(task.get_loop())


def _stored_turn(loop: asyncio.AbstractEventLoop) -> None:
    """The next event waiting on disk is held, if there is one and room for it."""
    waiting = _from_spool.get(loop)
    if waiting and len(_held) < MAX_HELD_EVENTS:
        turn = waiting.popleft()
        _hold(turn.js, turn.subject, turn.event, None, spooled=turn.spooled)


async def _publish_held(js: Callable[[], JetStreamContext], subject: str, event: AnyEvent,
                        spooled: HeldSpool | None) -> None:
    pause, longest = _HELD_RETRY_S
    offered = spooled is not None  # to a spool once, as soon as its process has one
    while True:
        if not offered and (spool := _spool_for(subject)) is not None:
            offered = True
            if await asyncio.to_thread(spool.write, subject, event):
                spooled = spool
        await asyncio.sleep(pause)
        try:
            await _publish_event_once(js(), subject, event)
        except (nats.errors.Error, TimeoutError):
            pause = min(pause * 2, longest)
            continue
        log.info("held event stored", extra={"kind": event_kind(event), "event_id": event.event_id})
        if spooled is not None:
            await asyncio.to_thread(spooled.remove, event.event_id)
        return

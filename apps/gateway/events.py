"""The gateway's events, off the request's hot path: a bounded queue published in the background.

Admission decisions and the runs no worker can report go to EVENTS for the ledger, but a request
never waits for that: an await there would be a point where a client that leaves could strand its
admission slot, and a slow bus would slow serving. `emit` never blocks; when the queue is full the
event is dropped and counted. The backlog is the `helexa:gateway_event_backlog` gauge; events
EVENTS refused (full, or the bus away) are held and published again (`helexa:gateway_events_held`).

EVENTS refuses new events when full rather than dropping old ones, so the gateway stops taking new
work before it gets there: the publisher reads how full EVENTS is every `ROOM_CHECK_S` (every
`ROOM_CHECK_IDLE_S` while it is under `EVENTS_NEAR_FULL_AT`, a reading that costs the server a
JetStream API call; none while the gateway emits nothing), and past
`EVENTS_FULL_AT` of a limit (or as soon as EVENTS refuses one of its events) `check_room` answers
new requests 503 `events_full` with `Retry-After`, until the recorder has caught up and trimmed
what it recorded (`helexa:gateway_events_full` is 1 meanwhile).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import nats.errors

from apps.bus import roles, topology
from apps.bus.codes import ErrorCode, Unavailable, unavailable
from apps.bus.event_publish import held_events, keep_held_on_disk, publish_event
from apps.bus.events import AnyEvent, event_kind
from apps.gateway.bus_client import GatewayBus
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.task_stop import cancel_until_done
from apps.settings import data_dir

log = logging.getLogger("helexa.gateway")

# Publishes in flight at once: each waits for its JetStream ack.
_PUBLISHERS = 4
# Share of an EVENTS limit past which new requests are refused: the rest is room for the events
# of the requests already running.
EVENTS_FULL_AT = 0.95
ROOM_CHECK_S = 1.0
# Under this share EVENTS is read less often: filling the rest takes far longer than the interval,
# and a refused event marks it full at once anyway.
EVENTS_NEAR_FULL_AT = 0.5
ROOM_CHECK_IDLE_S = 5.0


class EventPublisher:
    def __init__(self, bus: GatewayBus, metrics: GatewayMetrics, max_backlog: int = 10_000) -> None:
        self._bus = bus
        self._metrics = metrics
        # Each event with the subject kind it goes under (None: its own kind).
        self._queue: asyncio.Queue[tuple[AnyEvent, str | None]] = asyncio.Queue(max_backlog)
        self._tasks: list[asyncio.Task[None]] = []
        self.events_full = False
        # Set when an event is refused (EVENTS full), cleared at each reading of the room.
        self._refusal = asyncio.Event()
        # An event was queued since the last reading: a gateway that emits nothing admits nothing,
        # so it has no reason to read how full EVENTS is (the first event it emits again, or its
        # refusal, brings a reading).
        self._emitted = True
        metrics.event_backlog.set_function(lambda: self._queue.qsize())
        metrics.events_held.set_function(held_events)
        metrics.events_full.set_function(lambda: float(self.events_full))

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish_forever()) for _ in range(_PUBLISHERS)]
        self._tasks.append(asyncio.create_task(self._watch_room()))
        self._tasks.append(asyncio.create_task(keep_held_on_disk(self._bus.js, data_dir(), roles.GATEWAY,
                                                                 current=lambda: self._bus.js)))

    def check_room(self, model: str | None = None) -> None:
        """Refuse new work (503 events_full) while EVENTS has no room for its events."""
        if not self.events_full:
            return
        self._metrics.rejections.labels(model or "-", ErrorCode.EVENTS_FULL).inc()
        raise unavailable(Unavailable.EVENTS_FULL,
                          {"model": model, "detail": "EVENTS near its limit with unrecorded events"})

    def _refused(self) -> None:
        if not self.events_full:
            log.error("EVENTS refused an event: it is full; new requests are refused until it has room")
        self.events_full = True
        self._refusal.set()

    async def _watch_room(self) -> None:
        while True:
            if not (self._emitted or self.events_full):
                await self._pause(ROOM_CHECK_IDLE_S)
                continue
            self._emitted = False
            interval = ROOM_CHECK_S
            try:
                room = await topology.events_room(self._bus.js)
            except (nats.errors.Error, TimeoutError) as exc:
                log.debug("could not read how full EVENTS is", extra={"error": repr(exc)})
            else:
                if room.share() < EVENTS_NEAR_FULL_AT and not self.events_full:
                    interval = ROOM_CHECK_IDLE_S
                full = room.share() >= EVENTS_FULL_AT
                if full != self.events_full:
                    log.warning("EVENTS full: new requests refused" if full else "EVENTS has room again",
                                extra={"bytes": room.bytes, "max_bytes": room.max_bytes, "messages": room.messages,
                                       "max_msgs": room.max_msgs})
                self.events_full = full
            await self._pause(interval)

    async def _pause(self, interval: float) -> None:
        """Sleep `interval`, cut short once an event is refused, to ROOM_CHECK_S after the reading."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        self._refusal.clear()
        if not self.events_full:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._refusal.wait(), interval)
        await asyncio.sleep(max(started + ROOM_CHECK_S - loop.time(), 0.0))

    async def stop(self, drain_s: float = 2.0) -> None:
        """Give the backlog a moment to go out, then stop."""
        try:
            await asyncio.wait_for(self._queue.join(), drain_s)
        except TimeoutError:
            log.warning("events left unpublished at shutdown", extra={"backlog": self._queue.qsize()})
        if held_events():
            log.warning("events EVENTS did not take yet: the next gateway here publishes those on disk",
                        extra={"held": held_events()})
        # The room watch once survived a single cancellation: a gateway that could not bind its port hung.
        for task in self._tasks:
            await cancel_until_done(task)
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def emit(self, event: AnyEvent, subject_kind: str | None = None) -> None:
        """Queue `event` for publishing (under `subject_kind`, see `publish_event`); never blocks,
        never raises."""
        self._emitted = True
        try:
            self._queue.put_nowait((event, subject_kind))
        except asyncio.QueueFull:
            self._metrics.events_dropped.inc()

    async def _publish_forever(self) -> None:
        while True:
            # Everything queued goes at once: events of a subject share a message (`publish_event`).
            queued = [await self._queue.get()]
            while not self._queue.empty():
                queued.append(self._queue.get_nowait())
            try:
                await asyncio.gather(*(self._publish(event, subject_kind) for event, subject_kind in queued))
            finally:
                for _ in queued:
                    self._queue.task_done()

    async def _publish(self, event: AnyEvent, subject_kind: str | None) -> None:
        try:
            # Held and published again if EVENTS does not take it now (full, or the bus away).
            await publish_event(self._bus.js, event, on_full=self._refused, current=lambda: self._bus.js,
                                subject_kind=subject_kind)
        except Exception:  # one bad event must not stop the publisher
            log.exception("event dropped", extra={"kind": event_kind(event)})

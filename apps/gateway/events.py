"""The gateway's events, off the request's hot path: a bounded queue published in the background.

Admission decisions and the runs no worker can report go to EVENTS for the ledger, but a request
never waits for that: an await there would be a point where a client that leaves could strand its
admission slot, and a slow bus would slow serving. `emit` never blocks; when the queue is full the
event is dropped and counted. The backlog is the `helexa:gateway_event_backlog` gauge.
"""

from __future__ import annotations

import asyncio
import logging

from apps.bus import wire
from apps.bus.publish import publish_event
from apps.gateway.bus_client import GatewayBus
from apps.gateway.metrics import GatewayMetrics

log = logging.getLogger("helexa.gateway")

# Publishes in flight at once: each waits for its JetStream ack.
_PUBLISHERS = 4


class EventPublisher:
    def __init__(self, bus: GatewayBus, metrics: GatewayMetrics, max_backlog: int = 10_000) -> None:
        self._bus = bus
        self._metrics = metrics
        # Each event with the subject kind it goes under (None: its own kind).
        self._queue: asyncio.Queue[tuple[wire.AnyEvent, str | None]] = asyncio.Queue(max_backlog)
        self._tasks: list[asyncio.Task[None]] = []
        metrics.event_backlog.set_function(lambda: self._queue.qsize())

    @property
    def backlog(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._publish_forever()) for _ in range(_PUBLISHERS)]

    async def stop(self, drain_s: float = 2.0) -> None:
        """Give the backlog a moment to go out, then stop."""
        try:
            await asyncio.wait_for(self._queue.join(), drain_s)
        except TimeoutError:
            log.warning("events left unpublished at shutdown", extra={"backlog": self._queue.qsize()})
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def emit(self, event: wire.AnyEvent, subject_kind: str | None = None) -> None:
        """Queue `event` for publishing (under `subject_kind`, see `publish_event`); never blocks,
        never raises."""
        try:
            self._queue.put_nowait((event, subject_kind))
        except asyncio.QueueFull:
            self._metrics.events_dropped.inc()

    async def _publish_forever(self) -> None:
        while True:
            event, subject_kind = await self._queue.get()
            try:
                await publish_event(self._bus.js, event, subject_kind=subject_kind)  # logs a bus failure itself
            except Exception:  # one bad event must not stop the publisher
                log.exception("event dropped", extra={"kind": wire.event_kind(event)})
            finally:
                self._queue.task_done()

"""The recorder's Prometheus metrics and the watch on how far it is behind EVENTS.

Served at `http://HELEXA_RECORDER_METRICS_HOST:HELEXA_RECORDER_METRICS_PORT/metrics` when the port is
set. Every `HELEXA_RECORDER_WATCH_S` the watch reads the EVENTS stream and the recorders' shared
consumer: the lag (events not yet recorded, and the age of the oldest of them) and how close those
unrecorded events are to the stream's limits. EVENTS refuses new events past `max_bytes` (and
gateways then refuse new requests) and drops messages past `max_age`; once the unrecorded backlog
reaches 80% of either, the watch logs a warning and counts it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from http.server import HTTPServer

from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER, EventsRoom, room_of

log = logging.getLogger("helexa.recorder")

# Share of a limit the unrecorded events may fill before the warning.
WARN_AT = 0.8
# While the warning holds it is logged again this often (the metric shows it all along).
WARN_EVERY_S = 60.0


class RecorderMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events_recorded = Counter("helexa:recorder_events_recorded", "Events newly recorded into PostgreSQL",
                                       registry=r)
        self.dead_letters = Counter("helexa:recorder_dead_letters", "Events put in the dead-letter table",
                                    ["reason"], registry=r)
        self.lag_events = Gauge("helexa:recorder_lag_events", "EVENTS messages not yet recorded (pending + in hand)",
                                registry=r)
        self.lag_seconds = Gauge("helexa:recorder_lag_seconds", "Age of the oldest EVENTS message not yet recorded",
                                 registry=r)
        self.stream_bytes = Gauge("helexa:events_stream_bytes", "Bytes the EVENTS stream holds", registry=r)
        self.stream_messages = Gauge("helexa:events_stream_messages", "Messages the EVENTS stream holds", registry=r)
        self.limit_ratio = Gauge("helexa:events_unrecorded_limit_ratio",
                                 "Unrecorded EVENTS as a share of the stream's limit (1 = unrecorded events go)",
                                 ["limit"], registry=r)
        self.limit_warnings = Counter("helexa:events_limit_warnings",
                                      "Watches that found unrecorded EVENTS near a stream limit", ["limit"], registry=r)
        self.events_trimmed = Counter("helexa:events_trimmed",
                                      "Recorded events purged from EVENTS as it neared a limit", registry=r)
        for reason in ("undecodable", "rejected"):
            self.dead_letters.labels(reason)
        for limit in ("bytes", "age"):
            self.limit_ratio.labels(limit)
            self.limit_warnings.labels(limit)


class MetricsServer:
    """The `/metrics` exposition on its own thread; `close()` stops it."""

    def __init__(self, metrics: RecorderMetrics, host: str, port: int) -> None:
        self._server: HTTPServer
        self._thread: threading.Thread
        self._server, self._thread = start_http_server(port, addr=host, registry=metrics.registry)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)


@dataclass(slots=True, frozen=True)
class Lag:
    """One reading of EVENTS and the recorders' consumer."""

    unrecorded: int
    oldest_unrecorded_age_s: float
    stream_bytes: int
    stream_messages: int
    max_bytes: int  # <= 0: no limit
    max_age_s: float  # <= 0: no limit
    # How full EVENTS is, from the same reading (what trimming decides on).
    room: EventsRoom

    @property
    def bytes_ratio(self) -> float:
        if self.max_bytes <= 0 or not self.stream_messages:
            return 0.0
        # The unrecorded events are the newest ones; their size is estimated at the stream's average.
        return self.stream_bytes * min(self.unrecorded / self.stream_messages, 1.0) / self.max_bytes

    @property
    def age_ratio(self) -> float:
        return self.oldest_unrecorded_age_s / self.max_age_s if self.max_age_s > 0 else 0.0


async def measure(js: JetStreamContext, now: float | None = None) -> Lag:
    stream = await js.stream_info(EVENTS_STREAM)
    consumer = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
    unrecorded = (consumer.num_pending or 0) + (consumer.num_ack_pending or 0)
    age = 0.0
    if unrecorded:
        first = max((consumer.ack_floor.stream_seq if consumer.ack_floor else 0) + 1, stream.state.first_seq)
        try:
            oldest = await js.get_msg(EVENTS_STREAM, first)
        except NotFoundError:
            oldest = None  # just expired or deleted; the next reading sees the new oldest
        if oldest is not None and oldest.time is not None:
            age = max((now if now is not None else time.time()) - oldest.time.timestamp(), 0.0)
    return Lag(
        unrecorded=unrecorded,
        oldest_unrecorded_age_s=age,
        stream_bytes=stream.state.bytes,
        stream_messages=stream.state.messages,
        max_bytes=stream.config.max_bytes or -1,
        max_age_s=stream.config.max_age or 0.0,
        room=room_of(stream),
    )


class LagWatch:
    """Turns readings into metrics, and into a warning when unrecorded events near a limit."""

    def __init__(self, metrics: RecorderMetrics) -> None:
        self.metrics = metrics
        self._last_warned: dict[str, float] = {}

    async def check(self, js: JetStreamContext, now: float | None = None) -> Lag:
        lag = await measure(js, now)
        m = self.metrics
        m.lag_events.set(lag.unrecorded)
        m.lag_seconds.set(lag.oldest_unrecorded_age_s)
        m.stream_bytes.set(lag.stream_bytes)
        m.stream_messages.set(lag.stream_messages)
        for limit, ratio in (("bytes", lag.bytes_ratio), ("age", lag.age_ratio)):
            m.limit_ratio.labels(limit).set(ratio)
            if ratio < WARN_AT:
                self._last_warned.pop(limit, None)
                continue
            m.limit_warnings.labels(limit).inc()
            wall = time.monotonic()
            if wall - self._last_warned.get(limit, -WARN_EVERY_S) >= WARN_EVERY_S:
                self._last_warned[limit] = wall
                log.warning(
                    "EVENTS nearing its limit with unrecorded events",
                    extra={"limit": limit, "ratio": round(ratio, 3), "unrecorded": lag.unrecorded,
                           "lag_s": round(lag.oldest_unrecorded_age_s, 3), "stream_bytes": lag.stream_bytes,
                           "max_bytes": lag.max_bytes, "max_age_s": lag.max_age_s},
                )
        return lag

"""Every message an app sends, measured first; JetStream through a cluster's hiccups; events.

A NATS server counts a message's headers and body against its `max_payload` and answers one past
it with `-ERR maximum payload violation`, closing the connection for good (nats-py checks only
the body, so the headers' bytes were a window where a publish cost its connection). Every
publisher goes through `publish` (JetStream), `publish_core` (reply frames, cancels) or `respond`
(service replies) here: each measures the message as the server will (`message_size`) against
the connected server's `max_payload` and raises `TooLarge` before sending one that would not fit.
An event never raises it: one too large goes through the Object Store (`publish_event`).

When a NATS server of a cluster dies, the streams it led elect a new leader (a few seconds);
publishes meanwhile get no answer. Retrying with the same `Nats-Msg-Id` is safe (the stream's
dedupe window stores it once), so a request or event is stored, or the caller learns it was not.

A stream at its limits with the discard-new policy (REQUESTS, EVENTS) refuses the message: that
is not a hiccup, so it is raised at once as `StreamFull` instead of being retried. An event that
could not be stored (a full EVENTS, a bus outage) is held by this process and published again
until EVENTS takes it (`held_events` counts them), so nothing is dropped in silence.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

from apps.bus import topology, wire
from apps.bus.events import AnyEvent, EventRef, event_kind

log = logging.getLogger("helexa.bus")


# What JetStream answers (code 503, err_code 10077 "store failed") when a discard-new stream is full.
_STREAM_FULL_ERR_CODE = 10077
_FULL_DESCRIPTIONS = ("maximum messages exceeded", "maximum bytes exceeded", "maximum messages per subject exceeded")
_HEADER_LINE = b"NATS/1.0\r\n"
_HEADER_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})

# Events this process holds at most while EVENTS refuses them; past it one more is logged as lost.
MAX_HELD_EVENTS = 10_000
_HELD_RETRY_S = (0.5, 5.0)


class StreamFull(nats.errors.Error):
    """The stream is at one of its limits and refuses new messages; nothing stored was dropped.
    A `nats.errors.Error`, so code that treats any bus error as "unavailable" still catches it."""

    def __init__(self, subject: str, description: str) -> None:
        super().__init__(f"stream full for {subject}: {description}")
        self.subject = subject
        self.description = description


class TooLarge(nats.errors.MaxPayloadError):
    """Refused here, never sent: headers and body together exceed the server's max_payload."""

    def __init__(self, subject: str, size: int, limit: int) -> None:
        super().__init__()
        self.subject, self.size, self.limit = subject, size, limit

    def __str__(self) -> str:
        return f"a message of {self.size} bytes for {self.subject!r} (the server takes at most {self.limit})"


def message_size(payload: bytes, headers: dict[str, str] | None) -> int:
    """What the server counts against max_payload: the header block exactly as nats-py writes it
    (`NATS/1.0`, one `key: value` line per header, trimmed, a blank line), plus the body."""
    if not headers:
        return len(payload)
    lines = sum(len(f"{k.strip()}: {v.strip().translate(_HEADER_VALUE_NEWLINES)}\r\n".encode())
                for k, v in headers.items() if k.strip())
    return len(_HEADER_LINE) + lines + 2 + len(payload)


def fits(nc: NatsClient, payload: bytes, headers: dict[str, str] | None = None) -> bool:
    """Whether one message can carry this on the server `nc` is connected to now."""
    return message_size(payload, headers) <= nc.max_payload


def _check(nc: NatsClient, subject: str, payload: bytes, headers: dict[str, str] | None) -> None:
    size = message_size(payload, headers)
    if size > nc.max_payload:
        raise TooLarge(subject, size, nc.max_payload)


def client_of(js: JetStreamContext) -> NatsClient:
    """The connection a JetStream context publishes on (nats-py keeps it private)."""
    return js._nc  # private: no public accessor, and the measure needs its server's max_payload


def is_stream_full(exc: BaseException) -> bool:
    """Whether a publish error is a discard-new stream refusing a message at its limits."""
    if isinstance(exc, StreamFull):
        return True
    if not isinstance(exc, nats.js.errors.APIError):
        return False
    description = (exc.description or "").lower()
    return exc.err_code == _STREAM_FULL_ERR_CODE and any(d in description for d in _FULL_DESCRIPTIONS)


async def publish(js: JetStreamContext, subject: str, payload: bytes, msg_id: str,
                  within_s: float = 10.0) -> PubAck:
    """Publish until stored or `within_s` has passed; raises the last error then, `StreamFull` at
    once when the stream refuses the message at its limits, `TooLarge` before sending one that
    the server would refuse by closing the connection."""
    headers = {"Nats-Msg-Id": msg_id}
    deadline = time.monotonic() + within_s
    pause = 0.1
    while True:
        try:
            # Measured on each try: a reconnect may have landed on a server with another limit.
            _check(client_of(js), subject, payload, headers)
            return await js.publish(subject, payload, timeout=min(2.0, max(deadline - time.monotonic(), 0.1)),
                                    headers=headers)
        except TooLarge:
            raise
        except (nats.errors.Error, TimeoutError) as exc:
            if isinstance(exc, nats.js.errors.APIError) and is_stream_full(exc):
                raise StreamFull(subject, exc.description or "") from exc
            if time.monotonic() + pause > deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)


async def publish_core(nc: NatsClient, subject: str, payload: bytes = b"", reply: str = "",
                       headers: dict[str, str] | None = None) -> None:
    """A core NATS publish (reply frames, cancels), measured first: `TooLarge` instead of sending."""
    _check(nc, subject, payload, headers)
    await nc.publish(subject, payload, reply=reply, headers=headers)


async def respond(msg: Msg, payload: bytes) -> None:
    """Answer a request message, measured first: `TooLarge` instead of sending."""
    if not msg.reply:
        raise nats.errors.Error("no reply subject available")
    await publish_core(msg._client, msg.reply, payload)  # private: the client Msg.respond uses


_held: set[asyncio.Task[None]] = set()


def held_events() -> int:
    """Events this process holds because EVENTS did not take them yet."""
    return len(_held)


async def publish_event(js: JetStreamContext, event: AnyEvent, *, required: bool = False,
                        on_full: Callable[[], None] | None = None,
                        current: Callable[[], JetStreamContext] | None = None,
                        subject_kind: str | None = None) -> bool:
    """Put one event on EVENTS under `helexa.events.<kind>.<model>`, keyed by its event id; under
    `subject_kind` instead of its own kind when its role reports it on another's behalf
    (`topology.WORKER_LOST`, `topology.DROPPED`: see `apps.bus.roles`). An event too large for one
    message goes through the Object Store (`EventRef`).

    Serving never fails for the ledger's sake: an event EVENTS does not take now (full, or the bus
    unreachable) is held and published again in the background until it is stored, and False is
    returned; `on_full` hears that EVENTS was full, and `current` (for an app that replaces its
    connection) gives the context to publish the held event on later. `required` (the bench, whose
    results exist to be recorded) raises instead.
    """
    subject = topology.event_subject(subject_kind or event_kind(event), event.model)
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


async def _publish_event_once(js: JetStreamContext, subject: str, event: AnyEvent) -> None:
    body = wire.encode(event)
    if fits(client_of(js), body, {"Nats-Msg-Id": event.event_id}):
        await publish(js, subject, body, event.event_id)
        return
    # By reference: the object is named by the event id, so a retry replaces it and is stored once.
    store = await js.object_store(topology.LARGE_EVENTS_BUCKET)
    try:
        await store.put(event.event_id, body)
    except nats.js.errors.APIError as exc:
        if is_stream_full(exc):
            raise StreamFull(topology.LARGE_EVENTS_BUCKET, exc.description or "") from exc
        raise
    ref = EventRef(event_id=event.event_id, ts=event.ts, model=event.model, node=event.node,
                        ref_kind=event_kind(event), object=event.event_id, size=len(body),
                        digest=hashlib.sha256(body).hexdigest())
    await publish(js, subject, wire.encode(ref), event.event_id)


def _hold(js: Callable[[], JetStreamContext], subject: str, event: AnyEvent, exc: BaseException) -> None:
    context = {"kind": event_kind(event), "event_id": event.event_id,
               "request_id": getattr(event, "request_id", None), "error": wire.bounded_text(repr(exc))}
    if len(_held) >= MAX_HELD_EVENTS:
        log.error("event lost: too many events already held for EVENTS", extra={**context, "held": len(_held)})
        return
    log.warning("event held until EVENTS takes it", extra={**context, "held": len(_held) + 1})
    task = asyncio.ensure_future(_publish_held(js, subject, event))
    _held.add(task)
    task.add_done_callback(_held.discard)


async def _publish_held(js: Callable[[], JetStreamContext], subject: str, event: AnyEvent) -> None:
    pause, longest = _HELD_RETRY_S
    while True:
        await asyncio.sleep(pause)
        try:
            await _publish_event_once(js(), subject, event)
        except (nats.errors.Error, TimeoutError):
            pause = min(pause * 2, longest)
            continue
        log.info("held event stored", extra={"kind": event_kind(event), "event_id": event.event_id})
        return

"""Publishing to JetStream through a cluster's hiccups, and the one way any app publishes an event.

When a NATS server of a cluster dies, the streams it led elect a new leader (a few seconds);
publishes meanwhile get no answer. Retrying with the same `Nats-Msg-Id` is safe (the stream's
dedupe window stores it once), so a request or event is stored, or the caller learns it was not.

A stream at its limits with the discard-new policy (REQUESTS) refuses the message: that is not a
hiccup, so it is raised at once as `StreamFull` instead of being retried.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from apps.bus import topology, wire

log = logging.getLogger("helexa.bus")


# What JetStream answers (code 503, err_code 10077 "store failed") when a discard-new stream is full.
_STREAM_FULL_ERR_CODE = 10077
_FULL_DESCRIPTIONS = ("maximum messages exceeded", "maximum bytes exceeded", "maximum messages per subject exceeded")


class StreamFull(nats.errors.Error):
    """The stream is at one of its limits and refuses new messages; nothing stored was dropped.
    A `nats.errors.Error`, so code that treats any bus error as "unavailable" still catches it."""

    def __init__(self, subject: str, description: str) -> None:
        super().__init__(f"stream full for {subject}: {description}")
        self.subject = subject
        self.description = description


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
    """Publish until stored or `within_s` has passed; raises the last error then, or `StreamFull`
    at once when the stream refuses the message at its limits."""
    deadline = time.monotonic() + within_s
    pause = 0.1
    while True:
        try:
            return await js.publish(subject, payload, timeout=min(2.0, max(deadline - time.monotonic(), 0.1)),
                                    headers={"Nats-Msg-Id": msg_id})
        except (nats.errors.Error, TimeoutError) as exc:
            if isinstance(exc, nats.js.errors.APIError) and is_stream_full(exc):
                raise StreamFull(subject, exc.description or "") from exc
            if time.monotonic() + pause > deadline:
                raise
            await asyncio.sleep(pause)
            pause = min(pause * 2, 1.0)


async def publish_event(js: JetStreamContext, event: wire.AnyEvent, *, required: bool = False,
                        subject_kind: str | None = None) -> bool:
    """Put one event on EVENTS under `helexa.events.<kind>.<model>`, keyed by its event id; under
    `subject_kind` instead of its own kind when its role reports it on another's behalf
    (`topology.WORKER_LOST`, `topology.DROPPED`: see `apps.bus.roles`).

    Serving never fails for the ledger's sake: a publish that does not get through is logged and
    returns False. `required` (the bench, whose results exist to be recorded) raises instead.
    """
    kind = wire.event_kind(event)
    try:
        await publish(js, topology.event_subject(subject_kind or kind, event.model), wire.encode(event),
                      event.event_id)
    except (nats.errors.Error, TimeoutError) as exc:
        if required:
            raise
        log.warning("event publish failed", extra={"kind": kind, "request_id": getattr(event, "request_id", None),
                                                   "error": repr(exc)})
        return False
    return True

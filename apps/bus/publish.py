"""Every message an app sends, measured first; JetStream through a cluster's hiccups.

A NATS server counts a message's headers and body against its `max_payload` and answers one past
it with `-ERR maximum payload violation`, closing the connection for good (nats-py checks only
the body, so the headers' bytes were a window where a publish cost its connection). Every
publisher goes through `publish` (JetStream), `publish_core` (reply frames, cancels) or `respond`
(service replies) here: each measures the message as the server will (`message_size`) against
the connected server's `max_payload` and raises `TooLarge` before sending one that would not fit.
An event never raises it: one too large goes through the Object Store
(`apps.bus.event_publish`).

When a NATS server of a cluster dies, the streams it led elect a new leader (a few seconds);
publishes meanwhile get no answer. Retrying with the same `Nats-Msg-Id` is safe (the stream's
dedupe window stores it once), so a request or event is stored, or the caller learns it was not.

A stream at its limits with the discard-new policy (REQUESTS, EVENTS) refuses the message: that
is not a hiccup, so it is raised at once as `StreamFull` instead of being retried.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck

# What JetStream answers (code 503, err_code 10077 "store failed") when a discard-new stream is full.
_STREAM_FULL_ERR_CODE = 10077
_FULL_DESCRIPTIONS = ("maximum messages exceeded", "maximum bytes exceeded", "maximum messages per subject exceeded")
_HEADER_LINE = b"NATS/1.0\r\n"
_HEADER_VALUE_NEWLINES = str.maketrans({"\r": " ", "\n": " "})



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

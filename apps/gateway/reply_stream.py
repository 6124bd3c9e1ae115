"""One request's reply subject, read as frames: in order per attempt, duplicates and stale attempts
dropped, and pinned to the attempt that first sent the client text."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.subscription import Subscription

from apps.bus import wire

log = logging.getLogger("helexa.gateway")


class ReplyTimeout(Exception):
    """No frame arrived within the allowed silence."""


class ReplyStream:
    """Frames of one request's reply subject, in order, duplicates and stale attempts dropped.

    Once the client has been sent text, `lock()` pins the attempt that sent it: a later attempt
    (JetStream redelivered the request) would start the text again, so its frames are dropped.
    """

    def __init__(self, subscription: Subscription) -> None:
        self._sub = subscription
        # The requester's answer to liveness probes, and what to do on close; set by its owner.
        self.alive: Subscription | None = None
        self.on_close: Callable[[], None] | None = None
        self._next_seq = 0
        self._attempt = 0
        self._locked = False
        self.node: str | None = None

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def locked_attempt(self) -> int | None:
        return self._attempt if self._locked else None

    def lock(self) -> None:
        self._locked = True

    async def next(self, timeout_s: float) -> wire.ReplyFrame:
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplyTimeout
            try:
                msg = await self._sub.next_msg(timeout=remaining)
            except TimeoutError:  # nats-py raises its own or asyncio's; both are TimeoutError
                raise ReplyTimeout from None
            try:
                frame = wire.frame_decoder.decode(msg.data)
            except msgspec.DecodeError:
                log.warning("undecodable reply frame dropped", extra={"subject": msg.subject})
                continue
            if frame.attempt != self._attempt:
                # A redelivered request restarts the sequence; only a fresh attempt may do so.
                if frame.attempt < self._attempt or self._locked:
                    continue
                self._attempt, self._next_seq = frame.attempt, 0
            if frame.seq < self._next_seq:
                continue
            self._next_seq = frame.seq + 1
            if isinstance(frame, wire.Accepted):
                self.node = frame.node
            return frame

    async def close(self) -> None:
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        for sub in (self._sub, self.alive):
            if sub is None:
                continue
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass

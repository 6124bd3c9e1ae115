"""One request's reply subject, read as frames: in order per attempt, stale attempts dropped,
pinned to the attempt that first sent the client a delta, and held in a bounded buffer.

Each attempt numbers its frames from 0. A missing or repeated number inside the attempt being
read, or a new attempt whose first frame to arrive is not its frame 0, means frames were lost
(e.g. published while the gateway's subscription was moving to another server of the cluster):
`next` raises `frames_lost` rather than hand on an answer with a hole in it. A migrated request goes on as a
newer attempt (`migrate`): from then on, frames of the attempts before it are dropped.

Which frames arrive at all is decided before this: a request's reply subject is a secret only the
worker delivered it learns (`apps.gateway.bus_client`), and a migrated request moves to a new one
(`apps.gateway.reply_router`), so the worker that lost it cannot send a later attempt's frames here.

Frames arrive as fast as the worker makes them and leave as fast as the client reads. A client
that reads too slowly would make the gateway hold every frame in between, so the buffer is
bounded (frames and bytes): when it overflows, `on_overflow` runs at once (the request is
cancelled) and the reader gets a `client_too_slow` error instead of the rest of the frames.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable

import msgspec
import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError

log = logging.getLogger("helexa.gateway")

DEFAULT_MAX_FRAMES = 4096
MAX_BUFFERED_BYTES = 16 << 20


class ReplyTimeout(Exception):
    """No frame arrived within the allowed silence."""


class ReplyStream:
    """Frames of one request's reply subject, in order, duplicates and stale attempts dropped.

    Once the client has been sent a delta (text, or tokens whose text is held back), `lock()` pins
    the attempt that sent it: a later attempt (JetStream redelivered the request) would start the
    answer again, so its frames are dropped.
    The owner routes the reply subject's frames to `on_frame` (`apps.gateway.reply_router`) and
    sets `subscriptions` (closed with the stream) and `on_close`.
    """

    def __init__(self, max_frames: int = DEFAULT_MAX_FRAMES, on_overflow: Callable[[], None] | None = None) -> None:
        self.subscriptions: list[Subscription] = []
        self.on_close: Callable[[], None] | None = None
        self.node: str | None = None
        self._max_frames = max_frames
        self._on_overflow = on_overflow
        self._buffer: deque[bytes] = deque()
        self._buffered_bytes = 0
        # The reader's wait for a frame, and one timer that wakes it no later than its deadline.
        # A deadline moves on with every frame; the timer is not moved with it, only re-armed when
        # it fires early (one wake-up per silence allowance, not a timer per frame).
        self._waiter: asyncio.Future[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_due = 0.0
        # Raised by `next` once the buffer is drained (or at once, for an overflow).
        self._failure: ServingError | None = None
        self._next_seq = 0
        self._attempt = 0
        self._locked = False
        # Attempts below this one lost the request to a migration.
        self._base_attempt = 0

    @property
    def attempt(self) -> int:
        return self._attempt

    @property
    def base_attempt(self) -> int:
        return self._base_attempt

    @property
    def locked_attempt(self) -> int | None:
        return self._attempt if self._locked else None

    def lock(self) -> None:
        self._locked = True

    def migrate(self, base_attempt: int) -> None:
        """The request goes on as attempt `base_attempt` (or a redelivery of it): frames of the
        attempts before it are dropped from now, and the next attempt to send a delta is pinned."""
        self._base_attempt = self._attempt = base_attempt
        self._next_seq = 0
        self._locked = False

    async def on_message(self, msg: Msg) -> None:
        self.on_frame(msg.data)

    def on_frame(self, data: bytes) -> None:
        if self._failure is not None:
            return
        self._buffer.append(data)
        self._buffered_bytes += len(data)
        self._wake()
        if len(self._buffer) > self._max_frames or self._buffered_bytes > MAX_BUFFERED_BYTES:
            self._buffer.clear()
            self._buffered_bytes = 0
            self._failure = ServingError(408, ErrorCode.CLIENT_TOO_SLOW,
                                         "The client read the stream too slowly; the request was cancelled.")
            if self._on_overflow is not None:
                self._on_overflow()

    def fail(self, error: ServingError) -> None:
        """No more frames will come (e.g. the bus connection is gone): `next` raises `error`."""
        if self._failure is None:
            self._failure = error
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _timer_fired(self) -> None:
        self._timer = None
        self._wake()

    async def next(self, timeout_s: float) -> wire.ReplyFrame:
        """The next frame in order; raises the stream's failure, or ReplyTimeout after `timeout_s`
        without one. (One coroutine: it runs once per frame of every stream.)"""
        deadline = time.monotonic() + timeout_s
        while True:
            while not self._buffer:
                if self._failure is not None:
                    raise self._failure
                now = time.monotonic()
                if deadline <= now:
                    raise ReplyTimeout
                loop = asyncio.get_running_loop()
                if self._timer is None or self._timer_due > deadline:
                    if self._timer is not None:
                        self._timer.cancel()
                    self._timer, self._timer_due = loop.call_later(deadline - now, self._timer_fired), deadline
                self._waiter = loop.create_future()
                try:
                    await self._waiter
                finally:
                    self._waiter = None
            data = self._buffer.popleft()
            self._buffered_bytes -= len(data)
            try:
                frame = wire.frame_decoder.decode(data)
            except msgspec.DecodeError:
                log.warning("undecodable reply frame dropped")
                continue
            if frame.attempt != self._attempt:
                # A redelivered request restarts the sequence; only a fresh attempt may do so.
                if frame.attempt < self._attempt or self._locked:
                    continue
                self._attempt, self._next_seq = frame.attempt, 0
            if frame.seq != self._next_seq:
                raise ServingError(502, ErrorCode.FRAMES_LOST,
                                   f"Part of the answer was lost on the way (reply frame {self._next_seq} of "
                                   f"attempt {self._attempt} never arrived; frame {frame.seq} did).")
            self._next_seq = frame.seq + 1
            if isinstance(frame, wire.Accepted):
                self.node = frame.node
            return frame

    async def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
        for sub in self.subscriptions:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass
        self.subscriptions = []

"""One worker connection's reply frames on their way out: frames for one gateway share a message.

Every `Replier` of a connection hands its encoded frames here (`put`) instead of publishing them.
It waits for the connection (`send_now`) after a frame whose send must be known (the accepted,
final and error frames, heartbeats), and after a text delta only when the outbox is `backlogged`.
Frames put while the event loop runs one turn are sent together by one sender task: grouped by
the gateway connection they go to (`apps.bus.bundles`), several frames for one gateway become
one bundle message, split into several when one would pass the server's max_payload; a frame
alone, or for a reply subject that is not a gateway's, goes as it is. Frames of one stream keep
their order: they are put in order, grouped without reordering, and sent on one connection.

The frame window is shared too: a Replier holding text (or its streams' engine outputs) for its
window asks to be woken (`wake_at`); one timer, at the earliest of those deadlines, closes every
holder's window at once, so after the first flush the streams' windows close together and their
frames leave in one message. No held text waits past its own window (a wake-up may come earlier,
never later).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client as NatsClient

from apps.bus import bundles
from apps.bus.connection import one_per_connection
from apps.bus.publish import TooLarge, publish_core

log = logging.getLogger("helexa.worker")


# Frames put and not yet handed to the connection past which a Replier's delta waits for the
# outbox (its backpressure: a bus slower than the engine holds the generation back).
MAX_UNSENT_FRAMES = 1024


class Holder(Protocol):
    def window_closed(self) -> None: ...


class FrameOutbox:
    def __init__(self, nc: NatsClient) -> None:
        self.nc = nc
        self._pending: list[tuple[str, bytes, tuple[str, str] | None]] = []
        self._sender: asyncio.Task[None] | None = None
        self._holders: dict[Holder, None] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._deadline = 0.0
        # Messages and frames sent (the benchmark's and the tests' counts of what sharing saves).
        self.messages = 0
        self.frames = 0

    def put(self, subject: str, frame: bytes, bundle_key: tuple[str, str] | None) -> None:
        """Send `frame` to `subject` (whose `bundles.split_reply_subject` is `bundle_key`: the
        caller looks it up once per subject, not per frame)."""
        self._pending.append((subject, frame, bundle_key))
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send())
            self._sender.add_done_callback(_note_failure)

    @property
    def backlogged(self) -> bool:
        return len(self._pending) >= MAX_UNSENT_FRAMES

    async def send_now(self) -> None:
        """Hand everything put so far to the connection before returning (a frame that must not
        wait: a first token, a final frame), with whatever else this turn put beside it."""
        if self._sender is None or self._sender.done():
            self._sender = asyncio.get_running_loop().create_task(self._send())
            self._sender.add_done_callback(_note_failure)
        # A bus error reaches the Replier that waits, as a publish's did.
        await asyncio.shield(self._sender)

    def wake_at(self, holder: Holder, deadline: float) -> None:
        """Call `holder.window_closed()` by `deadline` (loop time), with every other holder due then."""
        self._holders[holder] = None
        if self._timer is None or deadline < self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._deadline = deadline
            self._timer = asyncio.get_running_loop().call_at(deadline, self._wake)

    def forget(self, holder: Holder) -> None:
        self._holders.pop(holder, None)

    def _wake(self) -> None:
        self._timer = None
        holders, self._holders = list(self._holders), {}
        for holder in holders:
            holder.window_closed()

    async def _send(self) -> None:
        # One loop turn first: the runs a closing window woke (`Replier.window_closed`) put their
        # frames in the turn after the wake-up, and those go in the same messages as the rest.
        await asyncio.sleep(0)
        while self._pending:
            pending, self._pending = self._pending, []
            for subject, payload in self._messages(pending):
                try:
                    await publish_core(self.nc, subject, payload)
                except TooLarge as exc:
                    # Each frame was measured as a message of its own when put: only a reconnect to
                    # a server with a smaller limit gets here.
                    log.error("reply message too large for the server now; dropped",
                              extra={"subject": subject, "size": exc.size, "max_payload": exc.limit})
                    continue
                self.messages += 1

    def _messages(self, pending: list[tuple[str, bytes, tuple[str, str] | None]]) -> list[tuple[str, bytes]]:
        """The messages that carry `pending`: a bundle per gateway home, as few as fit."""
        self.frames += len(pending)
        plain: list[tuple[str, bytes]] = []
        homes: dict[str, list[tuple[str, str, bytes]]] = {}
        for subject, frame, split in pending:
            if split is None:
                plain.append((subject, frame))
            else:
                homes.setdefault(split[0], []).append((subject, split[1], frame))
        messages = plain
        limit = self.nc.max_payload
        for home, frames in homes.items():
            for chunk in _chunks(frames, limit, lambda item: bundles.pair_size(item[1], item[2])):
                if len(chunk) == 1:
                    messages.append((chunk[0][0], chunk[0][2]))
                else:
                    messages.append((bundles.bundle_subject(home),
                                     bundles.encode([(token, frame) for _, token, frame in chunk])))
        return messages


def _note_failure(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("reply frames not sent", extra={"error": repr(task.exception())})


def _chunks(items: list[tuple[str, str, bytes]], limit: int,
            size: Callable[[tuple[str, str, bytes]], int]) -> list[list[tuple[str, str, bytes]]]:
    """`items` in order, cut where a bundle of them would pass `limit` bytes."""
    chunks: list[list[tuple[str, str, bytes]]] = []
    current: list[tuple[str, str, bytes]] = []
    used = bundles.LIST_OVERHEAD
    for item in items:
        cost = size(item)
        if current and used + cost > limit:
            chunks.append(current)
            current, used = [], bundles.LIST_OVERHEAD
        current.append(item)
        used += cost
    if current:
        chunks.append(current)
    return chunks


# The one outbox of a connection (every Replier on it shares it).
outbox_of = one_per_connection(FrameOutbox)

"""Batches from a JetStream pull consumer with one pull request per batch.

nats-py's `PullSubscription.fetch` waits for each message of a batch separately (a timer task per
message), which costs the recorder more than writing the event to PostgreSQL. `BatchPuller` sends
the same pull requests (`$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`) and collects what arrives
on a private inbox through one callback, so a batch costs one wait. The messages are ordinary
JetStream messages: ack, nak, term, in_progress and metadata work as usual.

A pull request ends when its batch is full or with a status message (404 no messages, 408 expired,
409 consumer changed or max_bytes reached, ...); 503 (no responders: JetStream is not up, as on a
server still recovering after a restart) fails the call, so no caller asks again in a tight loop.
A pull may be bounded in bytes as well as in messages (`max_bytes`): the server then stops before
the message that would exceed it, which stays for the next pull. Messages that arrive after a
request was given up on (a reply slower than our wait) are kept and handed out with the next
batch; they are delivered and waiting for an ack like any other. No call returns more than the batch it asked for.

An idle consumer costs one pull request (and the server's 408 answer) per wait: once a pull has
found nothing, the next `fetch` goes straight to the pull that waits, rather than first asking
again, with no_wait, for what was not there. A wait may be long, since it never holds anyone up:
`interrupt` ends it at once (a reconnect: a restarted server forgot it), and `stop` drains the
inbox, so the server drops a pull still waiting there (it delivers only to an inbox someone
listens on) and whatever it had already sent comes back to the caller to hand back.

The recorder and the worker's intake (`apps.worker.intake`) both pull this way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from apps.bus.reconnects import reconnects_of

_STATUS = "Status"
_HEARTBEAT = "100"
# JetStream is not there to answer (a restarted server still recovering its streams).
_NO_RESPONDERS = "503"
# How long `stop` waits for the server to confirm the inbox is gone.
DRAIN_TIMEOUT_S = 2.0


class BatchPuller:
    """Pull batches from `consumer` on `stream`; `await BatchPuller(...).start()` before `fetch`."""

    def __init__(self, nc: NatsClient, stream: str, consumer: str) -> None:
        self.nc = nc
        self.stream = stream
        self.consumer = consumer
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._sub: Subscription | None = None
        self._arrived: list[Msg] = []
        self._wanted = 0
        self._settled = asyncio.Event()
        # The last pull found nothing and nothing has arrived since.
        self._found_nothing = False
        # The call under way (or the next) was interrupted: it asks the server nothing more.
        self._interrupted = False
        self._stopped = False
        # A pull waits for a first message: nothing is pending on the consumer now (it would have
        # ended the wait). And the messages received since the start.
        self.waiting = False
        self.received = 0
        # The last pull was answered "no responders".
        self._unanswered = False
        # A `fetch` or `take_ready` is under way.
        self._in_call = False

    async def start(self) -> BatchPuller:
        self._sub = await self.nc.subscribe(self._inbox, cb=self._on_msg)
        reconnects_of(self.nc).add(self._reconnected)
        return self

    def _reconnected(self) -> None:
        """A restarted server forgot the pull under way: that call ends (the next asks afresh)."""
        if self._in_call:
            self.interrupt()

    def interrupt(self) -> None:
        """End the `fetch` under way (or else the next one) now, with what it has: a waiting pull
        as if nothing came. Its pull request stays at the server until it expires; a message it
        still brings is kept for the next call."""
        self._interrupted = True
        self._settled.set()

    async def stop(self) -> list[Msg]:
        """Pull nothing more: any wait ends now, the inbox is drained (what the server sent before
        it let go of the inbox still arrives) and every message that came and was not taken is
        returned, for the caller to hand back. Calls after it return nothing."""
        self._stopped = True
        self.interrupt()
        reconnects_of(self.nc).discard(self._reconnected)
        sub, self._sub = self._sub, None
        if sub is not None:
            try:
                await asyncio.wait_for(sub.drain(), DRAIN_TIMEOUT_S)  # type: ignore[no-untyped-call]
            except (nats.errors.Error, TimeoutError):
                # The connection is gone or going: what the server sent is lost with it, and its
                # ack wait hands it on.
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()
        return self._take(len(self._arrived))

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(_STATUS) if msg.headers else None
        if status is None:
            self.received += 1
            self._arrived.append(msg)
            self._found_nothing = False
            if len(self._arrived) >= self._wanted:
                self._settled.set()
        elif status != _HEARTBEAT:
            self._unanswered = status == _NO_RESPONDERS
            self._settled.set()

    async def _pull(self, batch: int, wait_s: float, no_wait: bool, max_bytes: int | None = None) -> None:
        """One pull request; returns when it ended or after `wait_s`, whichever is first (at once
        once interrupted)."""
        if self._interrupted:
            return
        self._wanted = len(self._arrived) + batch
        self._settled.clear()
        # The server ignores no_wait when expires is present, so they never go together.
        request: dict[str, int | bool] = (
            {"batch": batch, "no_wait": True} if no_wait else {"batch": batch, "expires": int(wait_s * 1e9)})
        if max_bytes is not None:
            request["max_bytes"] = max_bytes
        self.waiting = not no_wait
        self._unanswered = False
        await self.nc.publish(self._next_subject, json.dumps(request).encode(), reply=self._inbox)
        try:
            # A little past expires, so an idle request usually ends on the server's 408.
            await asyncio.wait_for(self._settled.wait(), wait_s + (0.0 if no_wait else 0.25))
        except TimeoutError:
            pass
        finally:
            self.waiting = False
        self._found_nothing = not self._arrived
        if self._unanswered:
            # As a failed fetch, so its caller pauses rather than asking again at once.
            raise nats.errors.NoRespondersError

    async def fetch(self, batch: int, timeout: float, max_bytes: int | None = None) -> list[Msg]:
        """Up to about `batch` messages (and about `max_bytes`): what is there now, else the first to
        arrive within `timeout`.

        Returns [] when nothing came; never raises on a timeout.
        """
        self._in_call = True
        try:
            if self._arrived or not self._found_nothing:
                msgs = await self._take_ready(batch, timeout, max_bytes)
                if msgs:
                    return msgs
            # Nothing there: wait for the first to arrive, then take what came with it.
            await self._pull(1, timeout, no_wait=False, max_bytes=max_bytes)
            if self._arrived and batch > 1:
                left = None if max_bytes is None else max_bytes - _size(self._arrived)
                if left is None or left > 0:
                    await self._pull(batch - 1, timeout, no_wait=True, max_bytes=left)
            return self._take(batch)
        finally:
            self._interrupted, self._in_call = self._stopped, False

    async def take_ready(self, batch: int, reply_wait_s: float = 1.0, max_bytes: int | None = None) -> list[Msg]:
        """Up to about `batch` messages (and about `max_bytes`) that are there now; never waits for
        one to arrive (only, at most `reply_wait_s`, for the server's answer)."""
        self._in_call = True
        try:
            return await self._take_ready(batch, reply_wait_s, max_bytes)
        finally:
            self._interrupted, self._in_call = self._stopped, False

    async def _take_ready(self, batch: int, reply_wait_s: float, max_bytes: int | None) -> list[Msg]:
        left = None if max_bytes is None else max_bytes - _size(self._arrived)
        if batch > len(self._arrived) and (left is None or left > 0):
            await self._pull(batch - len(self._arrived), reply_wait_s, no_wait=True, max_bytes=left)
        return self._take(batch)

    def _take(self, batch: int) -> list[Msg]:
        """Never more than `batch` (a worker pulls only what it has slots for): any more that came
        late wait for the next call."""
        msgs, self._arrived = self._arrived[:batch], self._arrived[batch:]
        return msgs


def _size(msgs: list[Msg]) -> int:
    return sum(len(msg.data) for msg in msgs)


def stream_sequence(msg: Msg) -> int:
    """The message's sequence in its stream, read straight from its ack subject.

    Same number as `msg.metadata.sequence.stream`, without building nats-py's Metadata (a datetime
    and two dataclasses per message), which costs the recorder more per event than the COPY does.
    Ack subjects are `$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<ts>.<pending>`
    or, from servers with domains, the same with `<domain>.<account hash>` after `ACK` and a random
    token at the end.
    """
    tokens = msg.reply.split(".")
    if len(tokens) < 9 or tokens[0] != "$JS" or tokens[1] != "ACK":
        raise ValueError(f"not a JetStream ack subject: {msg.reply!r}")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])

"""The gateway's half of request liveness: who is still there, on both sides of a generation.

The protocol, per request (the worker's half lives in `apps/worker/liveness.py`):

- **Listening first.** The gateway routes the request's reply subject to its stream (its
  connection's one subscription, `apps.gateway.reply_router`) and subscribes to
  `<reply subject>.alive` before it publishes, so no frame and no probe can be missed.
- **Alive probes.** While generating, a worker asks every second whether its requester still
  listens: for all its requests on one gateway connection at once, on the connection's home
  (`apps.bus.bundles`, answered by `apps.gateway.reply_router`), or per request on `<reply
  subject>.alive` (answered here, for workers that ask that way). An empty probe is answered with
  an empty body ("still listening"); when nobody answers (no responders) the gateway is gone and
  the worker aborts. A worker about to serve a *redelivered* attempt asks
  with its attempt number; once another attempt has sent the client text, or the request was
  migrated past that attempt, the answer is `topology.ATTEMPT_TAKEN` and that attempt must not run
  (text cannot be taken back).
- **Heartbeats.** A worker holding a request sends a `Heartbeat` frame every few seconds (and
  in-progress acks to JetStream). Silence longer than the stream idle timeout means: before any
  delta, the worker may have died holding the request (JetStream redelivers it after its ack wait),
  so keep waiting as a queued request would, up to the request's deadline; after one, the worker
  is lost: the request migrates to another worker (`apps/gateway/migration.py`), or past the
  migration limit the client gets `worker_lost` and later attempts are ignored.
- **Cancel.** When the client leaves early, or the gateway ends a request no worker will finish,
  the gateway publishes `helexa.cancel.<request id>`; workers abort idempotently. A migration
  never cancels: the cancel would reach the new attempt too.
- **Client hang-ups.** The HTTP client is watched too: a hang-up while the gateway waits on its
  behalf (queued, waiting for `Accepted`, or generating a non-streamed answer) ends the wait, and
  ending it publishes the cancel. While an SSE response streams, Litestar watches for the hang-up
  and stops the stream, which ends the generation the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.errors
from litestar import Request
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from apps.bus import topology, wire
from apps.bus.codes import Unavailable, unavailable
from apps.bus.publish import publish_core, respond
from apps.gateway.reply_stream import ReplyStream, ReplyTimeout

log = logging.getLogger("helexa.gateway")

T = TypeVar("T")


def attempt_taken(probe: bytes, locked_attempt: int | None, base_attempt: int = 0) -> bool:
    """Whether a probe asking for attempt `probe` must be refused: another attempt sent a delta, or
    the request was migrated past it."""
    try:
        asking = int(probe) if probe else None
    except ValueError:
        asking = None
    return asking is not None and is_taken(asking, locked_attempt, base_attempt)


def is_taken(asking: int, locked_attempt: int | None, base_attempt: int = 0) -> bool:
    return asking < base_attempt or locked_attempt not in (None, asking)


async def answer_probes(nc: NatsClient, reply: ReplyStream, reply_subject: str) -> Subscription:
    """Answer the workers' alive probes for one request while this process lives."""

    async def still_listening(msg: Msg) -> None:
        taken = attempt_taken(msg.data, reply.locked_attempt, reply.base_attempt)
        await respond(msg, topology.ATTEMPT_TAKEN if taken else b"")

    return await nc.subscribe(topology.alive_subject(reply_subject), cb=still_listening)


async def next_live_frame(reply: ReplyStream, idle_timeout_s: float, deadline: float) -> wire.ReplyFrame:
    """The next frame that is not a heartbeat (heartbeats only prove the worker is there).

    Silence before any delta keeps waiting until `deadline`; silence after one is `worker_lost`.
    """
    while True:
        try:
            frame = await reply.next(idle_timeout_s)
        except ReplyTimeout:
            if reply.locked_attempt is None and time.time() < deadline:
                continue
            raise unavailable(Unavailable.WORKER_SILENT) from None
        if not isinstance(frame, wire.Heartbeat):
            return frame


class Canceller:
    """Publishes `helexa.cancel.<id>`, even from code that is itself being cancelled."""

    def __init__(self, connection: Callable[[], NatsClient]) -> None:
        self._connection = connection
        self._background: set[asyncio.Task[None]] = set()

    def cancel_soon(self, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(self._cancel(request_id))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _cancel(self, request_id: str) -> None:
        try:
            await publish_core(self._connection(), topology.cancel_subject(request_id))
        except nats.errors.Error as exc:
            log.warning("cancel publish failed", extra={"request_id": request_id, "error": str(exc)})


async def _until_disconnected(client: Request) -> None:
    # The body has been read, so the next ASGI message can only be the client hanging up.
    while (await client.receive())["type"] != "http.disconnect":
        pass


class ClientGone(Exception):
    """The HTTP client hung up while the gateway was waiting on its behalf."""


async def while_connected(client: Request | None, work: Awaitable[T],
                          discard: Callable[[T], object] | None = None) -> T:
    """Await `work`, but cancel it (and wait for its cleanup) and raise ClientGone if the client
    hangs up first. If this await is itself cancelled after `work` produced a result, nobody
    will take that result: `discard` gets it (e.g. to release what it holds)."""
    if client is None:
        return await work
    task = asyncio.ensure_future(work)
    hangup = asyncio.create_task(_until_disconnected(client))
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        if discard is not None:
            task.add_done_callback(lambda done: discard(done.result())
                                   if not done.cancelled() and done.exception() is None else None)
        raise
    finally:
        hangup.cancel()
    if not task.done():
        task.cancel()
    try:
        return await task
    except asyncio.CancelledError:
        if asyncio.current_task().cancelling():  # type: ignore[union-attr]  # awaited in a task
            raise
        raise ClientGone from None

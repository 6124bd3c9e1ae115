"""The recorder loop: fetch a batch from the shared EVENTS consumer, commit it to Postgres, then ack.

A message is acked only after its batch committed, so a crash at any point means redelivery,
which the projector turns into a no-op. PostgreSQL being down (at start or mid-stream) is
waited out: the batch in hand is kept, marked in progress so JetStream does not hand it to
another recorder, and written again once the database is back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import asyncpg
import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from apps.bus.topology import RECORDER_CONSUMER, connect, ensure_topology, recorder_subscription
from apps.bus.wire import Event, event_decoder
from apps.logs import announce_ready
from apps.recorder.migrate import migrate
from apps.recorder.projector import project
from apps.settings import RecorderSettings

log = logging.getLogger("helexa.recorder")

FIRST_RETRY_S = 0.2
MAX_RETRY_S = 5.0
# Well inside the consumer's 60 s ack_wait.
IN_PROGRESS_EVERY_S = 15.0

# Errors that mean "the database is not reachable right now", as opposed to a bad statement.
# Deadlocks and serialization failures between concurrent recorders are retried the same way.
_UNAVAILABLE = (
    OSError,  # refused connections and timeouts
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.TransactionRollbackError,
)

Pending = list[tuple[Msg, Event]]


class Recorder:
    def __init__(self, settings: RecorderSettings, stop: asyncio.Event) -> None:
        self.settings = settings
        self.stop = stop
        self.pool: asyncpg.Pool | None = None

    async def until_done(self, what: str, op: Callable[[], Awaitable[object]], held: Sequence[Msg] = ()) -> bool:
        """Run `op` until it gets through to Postgres; False if `stop` was set first."""
        delay = FIRST_RETRY_S
        last_progress = time.monotonic()
        while not self.stop.is_set():
            try:
                await op()
                return True
            except _UNAVAILABLE as exc:
                log.warning(
                    "postgres unavailable, retrying",
                    extra={"during": what, "error": repr(exc), "retry_in_s": delay, "held": len(held)},
                )
                await self.close_pool()
            if held and time.monotonic() - last_progress >= IN_PROGRESS_EVERY_S:
                await _each(held, Msg.in_progress)
                last_progress = time.monotonic()
            await _pause(self.stop, delay)
            delay = min(delay * 2, MAX_RETRY_S)
        return False

    async def write(self, pending: Pending) -> None:
        if self.pool is None:
            self.pool = await asyncpg.create_pool(self.settings.database_url, min_size=0, max_size=2, timeout=5)
        async with self.pool.acquire() as conn:
            await project(conn, [(msg.subject, event) for msg, event in pending])

    async def record(self, pending: Pending) -> None:
        """Commit then ack; a batch the database rejects as data is split to find and drop the culprit."""
        msgs = [msg for msg, _ in pending]
        try:
            committed = await self.until_done("write", lambda: self.write(pending), held=msgs)
        except asyncpg.DataError as exc:
            if len(pending) > 1:
                for one in pending:
                    await self.record([one])
                return
            log.error("event rejected by postgres, terminated", extra=_describe(msgs[0], error=repr(exc)))
            await _each(msgs, Msg.term)
            return
        # Stopped during an outage: hand the batch back for redelivery now rather than after ack_wait.
        await _each(msgs, Msg.ack if committed else Msg.nak)

    async def close_pool(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep that ends early when `stop` is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


def _describe(msg: Msg, **fields: object) -> dict[str, object]:
    return {"subject": msg.subject, "stream_seq": msg.metadata.sequence.stream, **fields}


async def _each(msgs: Sequence[Msg], reply: Callable[[Msg], Awaitable[None]]) -> None:
    # Failing to reply only costs a redelivery, which is idempotent.
    for msg in msgs:
        try:
            await reply(msg)
        except nats.errors.Error as exc:
            log.warning("could not reply to event", extra=_describe(msg, reply=reply.__name__, error=repr(exc)))


async def decode(msgs: list[Msg]) -> Pending:
    """Decoded events; an undecodable message is terminated so it never blocks the ones behind it."""
    pending: Pending = []
    for msg in msgs:
        try:
            pending.append((msg, event_decoder.decode(msg.data)))
        except msgspec.DecodeError as exc:
            log.warning("undecodable event terminated", extra=_describe(msg, error=str(exc)))
            await _each([msg], Msg.term)
    return pending


async def _close(nc: NatsClient) -> None:
    # Not drain(): it waits out its timeout on a bound pull subscription. Flushing sends our last acks.
    try:
        await nc.flush(timeout=2)
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("could not flush acks before closing", extra={"error": repr(exc)})
    await nc.close()


async def run_recorder(settings: RecorderSettings, stop: asyncio.Event) -> None:
    """Record EVENTS into Postgres until `stop` is set."""
    recorder = Recorder(settings, stop)
    nc = await connect(settings.nats_url, "helexa-recorder")
    try:
        js = nc.jetstream()
        await ensure_topology(js)
        if not await recorder.until_done("migrate", lambda: migrate(settings.database_url)):
            return
        sub = await recorder_subscription(js)
        announce_ready("recorder", consumer=RECORDER_CONSUMER, batch_size=settings.batch_size)
        while not stop.is_set():
            try:
                msgs = await sub.fetch(batch=settings.batch_size, timeout=1)
            except TimeoutError:  # nats-py raises its own or asyncio's; both are TimeoutError
                continue
            except nats.errors.Error as exc:
                # NATS restarting or unreachable: the client reconnects by itself, the consumer is durable.
                log.warning("fetch failed, retrying", extra={"error": repr(exc)})
                await _pause(stop, 1.0)
                continue
            pending = await decode(msgs)
            if pending:
                await recorder.record(pending)
    finally:
        await recorder.close_pool()
        await _close(nc)

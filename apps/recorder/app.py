"""The recorder loop: fetch a batch from the shared EVENTS consumer, commit it to Postgres, then ack.

A message is acked only after its batch committed, so a crash at any point means redelivery,
which the projector turns into a no-op. PostgreSQL being down (at start or mid-stream), or failing
a write for a reason no event causes (a lock it may not wait for, a disk error, an internal error,
our schema or grants), is waited out: the batch in hand is kept, marked in progress so JetStream
does not hand it to another recorder, and written again once the database takes it. A write that
hangs (a lock held by an open transaction, a server gone without a reset) is ended after half the
consumer's ack wait and waited out the same way.

One event never stops the recorder: a message that does not decode, or an event PostgreSQL refuses
for its data (SQLSTATE classes 22, 23 and 54: a bad value, a constraint, an index row too large; or
a value asyncpg cannot send), is isolated by halving its batch and goes to the `dead_letters`
table with its error and stream sequence, and the events around it are recorded as usual (see
`dead_letters.py`; counted in `metrics.py`).

Events too large for one message come by reference and are read from the Object Store within a
byte budget per batch (`large_events.py`), and batches are pulled with a byte bound too
(HELEXA_RECORDER_BATCH_BYTES), so a batch's memory is bounded whatever clients stored. After a
batch that deleted responses commits, their events are removed from EVENTS as well; and EVENTS
(which refuses new events when full) is trimmed of recorded events as it nears its limits.

With `rebuild`, the recorder first recomputes the projections from the `events` table, then
replays the EVENTS stream from its first message through a private consumer (recording any event
the table lacks, e.g. after restoring an older backup), then goes on as usual.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from apps.bus.connection import connect
from apps.bus.declaration import Stopped, require_topology
from apps.bus.events import (
    BATCHED_KINDS,
    Event,
    EventRef,
    ResponseDeleted,
    ResponseStored,
    event_decoder,
    event_kind,
    event_parts,
)
from apps.bus.pull import BatchPuller, stream_sequence
from apps.bus.roles import RECORDER, event_refused
from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER, recorder_puller, replay_puller
from apps.logs import announce_ready, monotonic_ms
from apps.recorder import dead_letters, large_events, parts, projector
from apps.recorder.dead_letters import DeadLetter, Reason, kind_from_subject
from apps.recorder.metrics import LagWatch, MetricsServer, RecorderMetrics
from apps.recorder.migrate import migrate
from apps.settings import RecorderSettings
from apps.waiting import done_unless

log = logging.getLogger("helexa.recorder")

FIRST_RETRY_S = 0.2
MAX_RETRY_S = 5.0
REPLAY_BATCH = 1000
# What JetStream counts of a message beyond its body (subject, headers, reply) in a pull's max_bytes.
PULL_OVERHEAD_BYTES = 64 << 10
# Batches committing at once. Their transactions overlap, so one batch's WAL flush runs while the next
# is copied and projected; the projections are written for recorders side by side, so this is safe.
WRITERS = 2
# How long one wait for the next event lasts while EVENTS is idle (a stop or a reconnect ends it).
IDLE_WAIT_S = 10.0

# Errors that mean "the database is not reachable right now", as opposed to a bad statement.
# Deadlocks and serialization failures between concurrent recorders are retried the same way, and
# so are a read-only server (a failover under way) and refused credentials (being fixed).
_UNAVAILABLE = (
    OSError,  # refused connections and timeouts
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.exceptions.InsufficientResourcesError,
    asyncpg.exceptions.TransactionRollbackError,
    asyncpg.exceptions.ReadOnlySQLTransactionError,
    asyncpg.exceptions.InvalidAuthorizationSpecificationError,
)

# Our statements against this database's schema or grants (SQLSTATE class 42: an undefined table,
# a missing privilege): no event causes them, so they are waited out (a migration or GRANT fixes
# them) rather than sending every event to the dead-letter table.
_SCHEMA = (asyncpg.exceptions.SyntaxOrAccessError,)

# What PostgreSQL refuses for the events' own data; every other refusal (a lock not available, a
# disk or internal error) no event causes, and is waited out like an outage.
_BAD_DATA = (
    asyncpg.exceptions.DataError,  # class 22
    asyncpg.exceptions.IntegrityConstraintViolationError,  # class 23
    asyncpg.exceptions.ProgramLimitExceededError,  # class 54: e.g. an index row too large
)

# Unix seconds an event's `ts` may take (up to the year 2286): beyond, it cannot become a timestamptz.
_MAX_TS = 1e10


class WriteTimedOut(TimeoutError):
    """A batch's write ran past half the ack wait (an outage, as any TimeoutError)."""


def _retried(exc: BaseException) -> bool:
    """Whether a write error is waited out: all but the events' own bad data (a ValueError is bad
    input even when asyncpg raises it as an InterfaceError). A bug of ours (a TypeError in a
    projection) is waited out too, loudly: sending every event to the dead letters would hide it."""
    return not isinstance(exc, (ValueError, *_BAD_DATA))


def _outage(exc: BaseException) -> bool:
    """A retried error after which the connections are made again: not one a statement lost on its
    own (a deadlock, our schema, a refusal the server answered on a healthy connection)."""
    return _retried(exc) and isinstance(exc, _UNAVAILABLE) and not isinstance(
        exc, asyncpg.exceptions.TransactionRollbackError)


Pending = list[tuple[Msg, Event]]
Buried = list[tuple[Msg, DeadLetter]]


class _Identity(msgspec.Struct):
    """The fields that make an event idempotent; the wire defaults would invent new ones at each delivery."""

    event_id: str | None = None
    ts: float | None = None


_identity_decoder = msgspec.json.Decoder(_Identity)


class Recorder:
    def __init__(self, settings: RecorderSettings, stop: asyncio.Event, metrics: RecorderMetrics | None = None) -> None:
        self.settings = settings
        self.stop = stop
        self.metrics = metrics or RecorderMetrics()
        self.pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()
        # The bus, once connected: references are read and deleted responses erased through it.
        self.js: JetStreamContext | None = None
        # Well inside the consumer's ack_wait.
        self.in_progress_every_s = settings.ack_wait_s / 4

    async def until_done(self, what: str, op: Callable[[], Awaitable[object]], held: Sequence[Msg] = (),
                         halve_when_slow: bool = False) -> bool:
        """Run `op` until it gets through to Postgres; False if `stop` was set first. With
        `halve_when_slow`, a write that ran past its time is raised for its batch to be halved."""
        delay = FIRST_RETRY_S
        last_progress = time.monotonic()
        while not self.stop.is_set():
            try:
                await op()
                return True
            except Exception as exc:
                if not _retried(exc) or (halve_when_slow and isinstance(exc, WriteTimedOut)):
                    raise
                extra = {"during": what, "error": repr(exc), "retry_in_s": delay, "held": len(held),
                         "sqlstate": getattr(exc, "sqlstate", None)}
                if isinstance(exc, _SCHEMA):
                    log.error("postgres refuses the recorder's statements (schema or grants?), retrying", extra=extra)
                elif _outage(exc):
                    log.warning("postgres unavailable, retrying", extra=extra)
                elif isinstance(exc, asyncpg.PostgresError):
                    log.error("postgres failed the write for a reason no event causes, retrying", extra=extra)
                else:
                    log.error("the recorder failed, not the events: retrying", extra=extra, exc_info=exc)
            if held and time.monotonic() - last_progress >= self.in_progress_every_s:
                await _each(held, _IN_PROGRESS)
                last_progress = time.monotonic()
            await _pause(self.stop, delay)
            delay = min(delay * 2, MAX_RETRY_S)
        return False

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[asyncpg.Connection]:
        async with self._pool_lock:
            if self.pool is None:
                self.pool = await asyncpg.create_pool(
                    self.settings.database_url, min_size=0, max_size=WRITERS, timeout=5
                )
            pool = self.pool
        try:
            async with pool.acquire() as conn:
                yield conn
        except Exception as exc:
            # Start over with fresh connections after an outage, not when this transaction only lost a
            # deadlock or serialization conflict (or failed on its data or our schema). Only the pool
            # this write used: another writer failing on the same outage must not close the pool a
            # retry has opened meanwhile.
            if _outage(exc) and self.pool is pool:
                self.pool = None
                pool.terminate()
            raise

    async def write(self, pending: Pending) -> int:
        """One batch's commit, ended when it outlasts half the ack wait (WriteTimedOut: an outage,
        the connections made again; its socket is closed at once, as a server gone without a reset
        would never answer the cancel), so a write that hangs never holds the batch past its ack wait."""
        async with self.connection() as conn:
            try:
                async with asyncio.timeout(self.settings.ack_wait_s / 2):
                    return await projector.project(
                        conn, [projector.Recorded(msg.subject, e, stream_sequence(msg)) for msg, e in pending]
                    )
            except TimeoutError:
                conn.terminate()
                raise WriteTimedOut(f"the write of {len(pending)} events ran past "
                                    f"{self.settings.ack_wait_s / 2:g} s") from None

    async def record(self, pending: Pending, acks: bool = True) -> int:
        """Commit then ack; returns how many events were new.

        A batch that fails for any reason but an outage is halved until the culprit is alone, which
        goes to the dead-letter table (then is terminated when `acks`); one whose write runs past its
        time is halved too, and an event alone that does is waited out. Without `acks` (a replay)
        nothing is acked, nak'ed or held.
        """
        msgs = [msg for msg, _ in pending]
        new = 0

        async def write() -> None:
            nonlocal new
            new = await self.write(pending)

        try:
            committed = await self.until_done("write", write, held=msgs if acks else (),
                                              halve_when_slow=len(pending) > 1)
        except Exception as exc:
            if len(pending) > 1:
                half = len(pending) // 2
                return await self.record(pending[:half], acks) + await self.record(pending[half:], acks)
            msg, event = pending[0]
            await self.bury([(msg, DeadLetter(
                Reason.REJECTED, msg.subject, msg.data, repr(exc), stream_sequence(msg), event.event_id,
                event_kind(event), getattr(exc, "sqlstate", None),
            ))], acks)  # fmt: skip
            return 0
        if acks:
            # Stopped during an outage: hand the batch back for redelivery now rather than after ack_wait.
            await _each(msgs, _ACK if committed else _NAK)
        if committed:
            self.metrics.events_recorded.inc(new)
            # A deleted response's stored event may come after its deletion: either kind may erase.
            deleted = [e.response_id for _, e in pending if isinstance(e, ResponseDeleted | ResponseStored)]
            if deleted:
                await self.erase_from_bus(deleted)
        return new

    async def erase_from_bus(self, response_ids: list[str]) -> None:
        """The deleted responses' events off EVENTS (best effort: they expire with it otherwise)."""
        if self.js is None:
            return
        try:
            async with self.connection() as conn:
                await large_events.erase_from_bus(self.js, conn, response_ids)
        except Exception as exc:  # the ledger is erased already; the bus copy expires with EVENTS
            log.warning("deleted responses left on EVENTS until they expire",
                        extra={"responses": len(response_ids), "error": repr(exc)})

    async def resolved(self, pending: Pending, acks: bool = True) -> Pending:
        """`pending` with references replaced by their events (`large_events.resolve`), within the
        batch byte budget: the references past it are handed back (`acks`) or resolved in rounds."""
        if self.js is None or not any(isinstance(e, EventRef) for _, e in pending):
            return pending
        events, buried, later, unavailable = await large_events.resolve(self.js, pending, self.settings.batch_bytes)
        await self.bury(buried, acks)
        if unavailable and not acks:
            raise RuntimeError(f"the large-event store did not answer for {len(unavailable)} events; replay again")
        await _each([msg for msg, _ in unavailable], _NAK, delay=STORE_RETRY_S)
        if later and acks:
            await _each([msg for msg, _ in later], _NAK)
        elif later:
            # A replay acks nothing: what is left over is recorded in a round of its own.
            await self.record(events, acks=False)
            return await self.resolved(later, acks=False)
        return events

    async def bury(self, buried: Buried, acks: bool = True) -> None:
        """Keep events that cannot be recorded in `dead_letters`, then terminate them (when `acks`)."""
        if not buried:
            return
        msgs = [msg for msg, _ in buried]
        stored: list[bool] = []

        async def write() -> None:
            async with self.connection() as conn, conn.transaction():
                stored[:] = [await dead_letters.store(conn, letter) for _, letter in buried]

        kept = await self.until_done("dead letter", write, held=msgs if acks else ())
        for (msg, letter), new in zip(buried, stored if kept else [False] * len(buried), strict=True):
            if new:
                self.metrics.dead_letters.labels(letter.reason.value).inc()
            log.error("event dead-lettered", extra=_describe(msg, reason=letter.reason.value, error=letter.error,
                                                              sqlstate=letter.sqlstate, event_id=letter.event_id))
        if acks:
            await _each(msgs, _TERM if kept else _NAK)

    async def rebuild(self, nc: NatsClient) -> bool:
        """Recompute the projections from `events`, then replay EVENTS; False if stopped first."""
        started = time.monotonic()
        counts: dict[str, int] = {}

        async def from_table() -> None:
            async with self.connection() as conn:
                counts.update(await projector.rebuild(conn))

        log.info("rebuilding projections")
        if not await self.until_done("rebuild", from_table):
            return False
        rebuilt_ms = monotonic_ms(started)
        replayed, recorded = await self.replay(nc)
        if self.stop.is_set():
            return False
        log.info(
            "rebuild finished",
            extra={"rows": counts, "rebuilt_ms": rebuilt_ms, "replayed": replayed, "recorded": recorded,
                   "elapsed_ms": monotonic_ms(started)},
        )  # fmt: skip
        return True

    async def replay(self, nc: NatsClient) -> tuple[int, int]:
        """Read EVENTS from its first message up to its last at the start; returns (messages, new events)."""
        state = (await nc.jetstream().stream_info(EVENTS_STREAM)).state
        if state.messages == 0:
            return 0, 0
        puller = await replay_puller(nc)
        replayed = recorded = 0
        reached = 0  # the last stream sequence replayed
        try:
            while not self.stop.is_set():
                try:
                    msgs = await puller.fetch(REPLAY_BATCH, timeout=5, max_bytes=max(
                        self.settings.batch_bytes, nc.max_payload + PULL_OVERHEAD_BYTES))
                except nats.errors.NoRespondersError:
                    msgs = []  # its consumer is gone: looked at below
                if not msgs:
                    left = await _left_to_replay(nc.jetstream(), puller.consumer)
                    if left == 0:
                        break  # all delivered: the tail expired from the stream meanwhile
                    if left is None:
                        # The server removed the idle consumer (a ledger outage outlasted its
                        # inactive threshold): go on from where the replay got to.
                        log.warning("replay goes on with a new consumer", extra={"from_seq": reached + 1})
                        await _forget(puller)
                        puller = await replay_puller(nc, start_seq=reached + 1)
                    continue
                reached = stream_sequence(msgs[-1])
                replayed += len(msgs)
                pending, undecodable = decode(msgs)
                await self.bury(undecodable, acks=False)
                pending = await self.resolved(pending, acks=False)
                if pending:
                    recorded += await self.record(pending, acks=False)
                if stream_sequence(msgs[-1]) >= state.last_seq:
                    break
        finally:
            await _forget(puller)
        return replayed, recorded

    async def close_pool(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool = None


async def _left_to_replay(js: JetStreamContext, consumer: str) -> int | None:
    """Messages a replay's consumer has yet to deliver; None when the server no longer has it."""
    try:
        return (await js.consumer_info(EVENTS_STREAM, consumer)).num_pending
    except nats.js.errors.NotFoundError:
        return None


async def _pause(stop: asyncio.Event, seconds: float) -> None:
    """Sleep that ends early when `stop` is set."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


def _describe(msg: Msg, **fields: object) -> dict[str, object]:
    return {"subject": msg.subject, "stream_seq": stream_sequence(msg), **fields}


# Replies by name: a message's own method, as a part of a shared message (`parts.Part`) has its own.
_ACK, _NAK, _TERM, _IN_PROGRESS = "ack", "nak", "term", "in_progress"
# How long an event whose object the large-event store did not give back waits to be tried again.
STORE_RETRY_S = 1.0


async def _each(msgs: Sequence[Msg], reply: str, **options: float) -> None:
    # Failing to reply only costs a redelivery, which is idempotent.
    for msg in msgs:
        try:
            await getattr(msg, reply)(**options)
        except nats.errors.Error as exc:
            log.warning("could not reply to event", extra=_describe(msg, reply=reply, error=repr(exc)))


def decode(msgs: list[Msg]) -> tuple[Pending, Buried]:
    """The events, and the messages that are none (for the dead-letter table), so they never block the
    ones behind them. An event without its own event_id and ts, or with a ts no timestamp can hold,
    counts as undecodable."""
    pending: Pending = []
    undecodable: Buried = []
    for whole in msgs:
        try:
            each = parts_of(whole)
        except msgspec.DecodeError as exc:
            undecodable.append(_undecodable(whole, exc))
            continue
        for msg in each:
            _decode_one(msg, pending, undecodable)
    return pending, undecodable


def parts_of(msg: Msg) -> list[Msg]:
    """The message, or one part per event when it carries several (`apps.recorder.parts`); only
    the kinds `BATCHED_KINDS` names may share a message."""
    events = event_parts(msg.data)
    if not events:
        raise msgspec.ValidationError("an EVENTS message carries at least one event")
    if len(events) > 1 and kind_from_subject(msg.subject) not in BATCHED_KINDS:
        raise msgspec.ValidationError(f"{kind_from_subject(msg.subject)} events go one to a message")
    return parts.split(msg, events)


def _decode_one(msg: Msg, pending: Pending, undecodable: Buried) -> None:
    try:
        identity = _identity_decoder.decode(msg.data)
        if identity.event_id is None or identity.ts is None:
            raise msgspec.ValidationError("an event needs its own `event_id` and `ts`")
        if not 0 <= identity.ts < _MAX_TS:
            raise msgspec.ValidationError(f"`ts` {identity.ts} is not a time PostgreSQL can record")
        event = event_decoder.decode(msg.data)
        refused = event_refused(msg.subject, event)  # only its kind's publishers may send it there
        if refused is not None:
            raise msgspec.ValidationError(refused)
        pending.append((msg, event))
    except msgspec.DecodeError as exc:
        undecodable.append(_undecodable(msg, exc))


def _undecodable(msg: Msg, exc: msgspec.DecodeError) -> tuple[Msg, DeadLetter]:
    return msg, DeadLetter(Reason.UNDECODABLE, msg.subject, msg.data, str(exc), stream_sequence(msg),
                           kind=kind_from_subject(msg.subject))


async def _forget(puller: BatchPuller) -> None:
    # Best effort: the server drops an inactive replay consumer by itself.
    try:
        await puller.stop()
        await puller.nc.jetstream().delete_consumer(puller.stream, puller.consumer)
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("could not delete the replay consumer", extra={"error": repr(exc)})


async def _close(nc: NatsClient) -> None:
    # Not drain(): it waits out its timeout on a bound pull subscription. Flushing sends our last acks.
    try:
        await nc.flush(timeout=2)
    except (nats.errors.Error, TimeoutError) as exc:
        log.warning("could not flush acks before closing", extra={"error": repr(exc)})
    await nc.close()


async def _fetch(puller: BatchPuller, batch_size: int, linger_s: float, stop: asyncio.Event,
                 batch_bytes: int) -> list[Msg]:
    """The next batch, of at most `batch_size` events and about `batch_bytes`. One that is not full
    waits `linger_s` from its first event for the rest of its burst, so a burst of requests costs
    one commit, made after its prefill, not several made during it, on the cores the engine is using."""
    try:
        msgs = await _fetched_unless_stopped(puller, stop, puller.fetch(batch_size, timeout=IDLE_WAIT_S,
                                                                       max_bytes=batch_bytes))
    except nats.errors.Error as exc:
        # NATS restarting or unreachable: the client reconnects by itself, the consumer is durable.
        log.warning("fetch failed, retrying", extra={"error": repr(exc)})
        await _pause(stop, 1.0)
        return []
    if msgs and len(msgs) < batch_size and linger_s > 0:
        await _pause(stop, linger_s)
        # The batch in hand is kept whatever happens to the top-up (a failed pull takes nothing).
        with contextlib.suppress(nats.errors.Error):
            left = batch_bytes - sum(len(msg.data) for msg in msgs)
            msgs += await puller.take_ready(batch_size - len(msgs), max_bytes=left)
    return msgs


async def _fetched_unless_stopped(puller: BatchPuller, stop: asyncio.Event,
                                  fetching: Coroutine[Any, Any, list[Msg]]) -> list[Msg]:
    """What `fetching` brings; its wait ends at once when `stop` is set."""
    fetched = asyncio.ensure_future(fetching)
    if not await done_unless(fetched, stop):
        puller.interrupt()
    return await fetched


async def _consume(recorder: Recorder, puller: BatchPuller) -> None:
    """Record batch after batch, up to WRITERS at once; the next batch is fetched while they commit.
    Each batch is acked after its own commit, whatever order the commits finish in."""
    stop, batch_size, linger_s = recorder.stop, recorder.settings.batch_size, recorder.settings.linger_ms / 1000
    # Never below one message of the largest size the server takes, which would never be pulled.
    batch_bytes = max(recorder.settings.batch_bytes, puller.nc.max_payload + PULL_OVERHEAD_BYTES)
    writing: set[asyncio.Task[int]] = set()
    ahead = asyncio.create_task(_fetch(puller, batch_size, linger_s, stop, batch_bytes))
    try:
        while not stop.is_set():
            msgs = await ahead
            ahead = asyncio.create_task(_fetch(puller, batch_size, linger_s, stop, batch_bytes))
            pending, undecodable = decode(msgs)
            await recorder.bury(undecodable)
            pending = await recorder.resolved(pending)
            if not pending:
                continue
            if len(writing) >= WRITERS:
                done, writing = await asyncio.wait(writing, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # a write fails only on a bug: let it end the recorder
            writing.add(asyncio.create_task(recorder.record(pending)))
    finally:
        # Let the batches being written commit and ack; hand back what was fetched ahead.
        for result in await asyncio.gather(*writing, return_exceptions=True):
            if isinstance(result, BaseException):
                log.error("batch write failed", extra={"error": repr(result)})
        await _each(await ahead, _NAK)


async def _watch(recorder: Recorder, nc: NatsClient, puller: BatchPuller) -> None:
    """Read the lag and the EVENTS limits every `watch_interval_s` until stopped, and trim recorded
    events off EVENTS as it nears a limit. A reading that found nothing unrecorded still holds
    while no event has come since and a pull waits (nothing is pending, or the wait would have
    ended), so an idle recorder asks JetStream nothing."""
    watch = LagWatch(recorder.metrics)
    quiet, received = False, -1
    while not recorder.stop.is_set():
        if not (quiet and puller.waiting and puller.received == received):
            received = puller.received
            try:
                lag = await watch.check(nc.jetstream())
                recorder.metrics.events_trimmed.inc(await large_events.trim_recorded(nc.jetstream(), lag.room))
                quiet = lag.unrecorded == 0
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("could not read the recorder's lag", extra={"error": repr(exc)})
                quiet = False
        await _pause(recorder.stop, recorder.settings.watch_interval_s)


async def run_recorder(settings: RecorderSettings, stop: asyncio.Event, rebuild: bool = False) -> None:
    """Record EVENTS into Postgres until `stop` is set; with `rebuild`, rebuild the projections first."""
    recorder = Recorder(settings, stop)
    exposition = (MetricsServer(recorder.metrics, settings.metrics_host, settings.metrics_port)
                  if settings.metrics_port else None)
    try:
        nc = await connect(settings.nats_url, "helexa-recorder", role=RECORDER, stop=stop)
    except Stopped:
        return
    recorder.js = nc.jetstream()
    watching: asyncio.Task[None] | None = None
    try:
        try:
            await require_topology(nc.jetstream(), stop=stop)
        except Stopped:
            return
        # Applied by the database's owner (`helexa up`, `helexa migrate`) unless this role may.
        if not await recorder.until_done("migrate", lambda: migrate(settings.database_url)):
            return
        if rebuild and not await recorder.rebuild(nc):
            return
        puller = await recorder_puller(nc, settings.ack_wait_s)
        watching = asyncio.create_task(_watch(recorder, nc, puller))
        metrics_url = f"http://{settings.metrics_host}:{settings.metrics_port}/metrics" if exposition else None
        announce_ready("recorder", consumer=RECORDER_CONSUMER, batch_size=settings.batch_size, metrics=metrics_url)
        await _consume(recorder, puller)
    finally:
        if watching is not None:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
        await recorder.close_pool()
        await _close(nc)
        if exposition is not None:
            exposition.close()

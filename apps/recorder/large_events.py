"""The recorder's side of events stored by reference, of deleted responses, and of a full EVENTS.

An event too large for one bus message arrives as a `EventRef`; `resolve` reads the event
itself from the `helexa_events` Object Store, within a byte budget per batch (the references past
it are handed back for the next batch), so a batch of references costs bounded memory. A read the
store does not answer (a NATS restart, a timeout) hands the reference back to be tried again a
moment later; only an object that is gone or is not its event makes a dead letter. The
`events` table records the event itself, so rebuilding needs no object.

A deleted response's content is erased from the ledger by the projector; `erase_from_bus` also
removes its response.stored message from EVENTS (the copy the ledger recorded; a copy republished
after the dedupe window stays until it expires) and its object, so the content is gone from the
bus too (best effort: what fails is logged and expires with EVENTS' max_age).

EVENTS refuses new events when full (discard-new) rather than dropping old ones; `trim_recorded`
purges, as the stream nears its limits, the events every recorder has recorded (below the shared
consumer's ack floor), so only unrecorded events can ever fill it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from typing import NamedTuple

import asyncpg
import msgspec
import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError, ObjectNotFoundError

from apps.bus import topology
from apps.bus.events import Event, EventRef, event_decoder, event_kind
from apps.bus.object_streams import read_stream
from apps.bus.pull import stream_sequence
from apps.bus.roles import event_refused
from apps.recorder.dead_letters import DeadLetter, Reason

log = logging.getLogger("helexa.recorder")

# Share of a limit EVENTS may fill before the recorded events in it are purged.
TRIM_AT = 0.8
# JetStream's err_codes for deleting a message that is not there (any more): "no message found",
# "sequence not found".
_NO_MESSAGE = (10057, 10043)

# What the Object Store answers for an object that will never be readable (gone, or not an object of
# ours): its reference is a dead letter. Any other NATS error is the store not answering now.
_NOT_ITS_OBJECT = (ObjectNotFoundError, nats.js.errors.BadObjectMetaError, nats.js.errors.DigestMismatchError,
                   nats.js.errors.LinkIsABucketError)
# One object's read, at most (an object is at most a few MiB: the largest event the bounds allow).
OBJECT_READ_S = 30.0

_STORED_EVENTS = """
SELECT event_id, stream_seq FROM events
WHERE kind = 'response.stored' AND payload->>'response_id' IN (
    SELECT response_id FROM responses WHERE response_id = ANY($1::text[]) AND deleted_at IS NOT NULL)
"""


class Resolved(NamedTuple):
    """What `resolve` made of a batch: the events (references replaced), the dead letters, the
    references past the byte budget (for the next batch), and those whose object could not be
    read now (the store unreachable: timed out, no responders) to be tried again later."""

    events: list[tuple[Msg, Event]]
    buried: list[tuple[Msg, DeadLetter]]
    later: list[tuple[Msg, Event]]
    unavailable: list[tuple[Msg, Event]]


async def resolve(js: JetStreamContext, pending: Sequence[tuple[Msg, Event]], budget_bytes: int) -> Resolved:
    """Each reference replaced by its event while the objects read stay within `budget_bytes` (the
    first one always is, so a batch makes progress); a reference whose object is gone or is not its
    event is a dead letter. Once the store fails to answer, the references left are not tried."""
    out = Resolved([], [], [], [])
    spent = 0
    for msg, event in pending:
        if not isinstance(event, EventRef):
            out.events.append((msg, event))
            continue
        if out.unavailable:
            out.unavailable.append((msg, event))
            continue
        if spent and spent + event.size > budget_bytes:
            out.later.append((msg, event))
            continue
        spent += event.size
        try:
            data = await _read_object(js, event.object)
            if hashlib.sha256(data).hexdigest() != event.digest:
                raise msgspec.ValidationError("the object is not the one its reference names (digest)")
            resolved = event_decoder.decode(data)
            if resolved.event_id != event.event_id or event_kind(resolved) != event.ref_kind:
                raise msgspec.ValidationError("the object is not the event its reference names")
            refused = event_refused(msg.subject, resolved)  # as for an event that came inline
            if refused is not None:
                raise msgspec.ValidationError(refused)
        except (*_NOT_ITS_OBJECT, msgspec.DecodeError) as exc:
            error = str(exc) if isinstance(exc, msgspec.DecodeError) else f"its object is unreadable ({exc!r})"
            if isinstance(exc, ObjectNotFoundError):
                error = "its object is gone from the store"
            out.buried.append((msg, DeadLetter(Reason.UNDECODABLE, msg.subject, msg.data, f"event reference: {error}",
                                               stream_sequence(msg), event.event_id, event.ref_kind)))
            continue
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("large-event store unavailable", extra={"event_id": event.event_id, "error": repr(exc)})
            out.unavailable.append((msg, event))
            continue
        out.events.append((msg, resolved))
    return out


async def _read_object(js: JetStreamContext, name: str) -> bytes:
    """The whole object `name` of the large-event store, read within OBJECT_READ_S: its chunks'
    subscription ends with the read however it ends (nats-py's own `get` waits for chunks without
    a bound, and leaves its subscription behind when cancelled)."""
    async with asyncio.timeout(OBJECT_READ_S):
        info = await (await js.object_store(topology.LARGE_EVENTS_BUCKET)).get_info(name)
        async with contextlib.aclosing(read_stream(js, info)) as chunks:
            return b"".join([chunk async for chunk in chunks])


async def erase_from_bus(js: JetStreamContext, conn: asyncpg.Connection, response_ids: list[str]) -> int:
    """Remove the response.stored messages (and objects) of deleted responses from EVENTS; how many."""
    removed = 0
    for row in await conn.fetch(_STORED_EVENTS, response_ids):
        try:
            if row["stream_seq"] is not None:
                await js.delete_msg(topology.EVENTS_STREAM, row["stream_seq"])
                removed += 1
        except nats.js.errors.APIError as exc:
            if not isinstance(exc, NotFoundError) and exc.err_code not in _NO_MESSAGE:
                log.warning("a deleted response's event stays on EVENTS until it expires",
                            extra={"event_id": row["event_id"], "error": repr(exc)})
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("a deleted response's event stays on EVENTS until it expires",
                        extra={"event_id": row["event_id"], "error": repr(exc)})
        try:
            store = await js.object_store(topology.LARGE_EVENTS_BUCKET)
            await store.delete(row["event_id"])
        except (ObjectNotFoundError, NotFoundError):
            pass  # it came inline
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("a deleted response's object stays until its TTL",
                        extra={"event_id": row["event_id"], "error": repr(exc)})
    return removed


async def trim_recorded(js: JetStreamContext, room: topology.EventsRoom | None = None) -> int:
    """Purge the recorded events of EVENTS once it fills past TRIM_AT of a limit; how many went.
    `room`: how full EVENTS is, if just read."""
    if room is None:
        room = await topology.events_room(js)
    if room.share() < TRIM_AT:
        return 0
    consumer = await js.consumer_info(topology.EVENTS_STREAM, topology.RECORDER_CONSUMER)
    floor = consumer.ack_floor.stream_seq if consumer.ack_floor else 0
    before = room.messages
    if floor <= 0:
        return 0
    # Everything below seq `floor + 1` is acked by the recorders' shared consumer: recorded.
    await js.purge_stream(topology.EVENTS_STREAM, seq=floor + 1)
    after = await topology.events_room(js)
    trimmed = max(before - after.messages, 0)
    log.info("recorded events trimmed from EVENTS near its limit",
             extra={"trimmed": trimmed, "up_to_seq": floor, "share_before": round(room.share(), 3),
                    "share_after": round(after.share(), 3)})
    return trimmed

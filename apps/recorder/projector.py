"""The SQL side of the recorder: a batch of events into `events`, and from there into the projections.

One transaction per batch. The batch is COPYed into a staging table, inserted into `events` (an
event already there is not inserted again), and the staging table is cut down to the events this
insert actually added; only those are projected, so a redelivered event is a no-op and at-least-once delivery
yields exactly-once rows. What each event kind writes, and how rows merge, is `apps.recorder.projections`.

PostgreSQL's jsonb holds no NUL character: a `\u0000` in an event's strings is recorded as U+FFFD
(the replacement character), the one lossy step between the bus and the ledger, so an event with
one is recorded rather than dead-lettered.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import NamedTuple

import asyncpg

from apps.bus.events import (
    Event,
    RunFinished,
    RunStarted,
    event_kind,
)
from apps.bus.wire import encode
from apps.recorder.projections import PROJECTIONS, Statements

__all__ = ["Recorded", "event_kind", "ledger_json", "project", "rebuild"]

# A JSON `\u0000` escape (not an escaped backslash followed by "u0000"): an odd run of backslashes.
_NUL_ESCAPE = re.compile(rb"(?<!\\)((?:\\\\)*)\\u0000")

_EVENT_COLUMNS = ("event_id", "kind", "subject", "model", "node", "ts", "payload", "stream_seq")
_STAGING = "incoming_events"


class Recorded(NamedTuple):
    """An event as it came off the stream."""

    subject: str
    event: Event
    stream_seq: int | None = None


# The staging table lives for the session and is emptied at every commit.
_CREATE_STAGING = f"CREATE TEMP TABLE IF NOT EXISTS {_STAGING} (LIKE events INCLUDING DEFAULTS) ON COMMIT DELETE ROWS"

# A copy already recorded only lowers `stream_seq` to the earliest copy seen, whichever batch commits
# first (batches of one recorder, or of several, commit in any order). `xmax = 0` marks a row this
# statement inserted rather than updated: only those are new, and only they stay staged.
_INSERT_NEW = f"""
WITH fresh AS (
    INSERT INTO events AS old ({", ".join(_EVENT_COLUMNS)})
    SELECT {", ".join(_EVENT_COLUMNS)} FROM {_STAGING} ORDER BY event_id
    ON CONFLICT (event_id) DO UPDATE SET stream_seq = EXCLUDED.stream_seq
        WHERE EXCLUDED.stream_seq < old.stream_seq
    RETURNING event_id, old.xmax = 0 AS inserted
)
DELETE FROM {_STAGING} AS s
WHERE NOT EXISTS (SELECT FROM fresh WHERE fresh.event_id = s.event_id AND fresh.inserted)
"""

_LIVE = Statements(_STAGING)
_ALL = Statements("events")


def _time(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


async def _apply(conn: asyncpg.Connection, statements: Statements, kinds: set[str], rounds: int) -> None:
    for kind, sql in statements.by_kind.items():
        if kind in kinds:
            await conn.execute(sql)
    if kinds & statements.erasing_kinds:
        await conn.execute(statements.responses_erased)
    for round_ in range(1, rounds + 1):
        for statement in statements.run_rounds:
            await conn.execute(statement, round_)


def ledger_json(event: Event) -> str:
    """The event's JSON as the `events` table holds it: NUL escapes become U+FFFD (see above)."""
    return _NUL_ESCAPE.sub(rb"\1\\ufffd", encode(event)).decode()


async def project(conn: asyncpg.Connection, batch: Sequence[Recorded | tuple[str, Event]]) -> int:
    """Record events in one transaction; returns how many of them were new."""
    unique: dict[str, Recorded] = {}
    for item in batch:
        # The first copy wins, so `stream_seq` names the earliest one whatever the batch size.
        unique.setdefault(item[1].event_id, Recorded(*item))
    if not unique:
        return 0
    kinds = {event_kind(r.event) for r in unique.values()}
    per_request = Counter(
        r.event.request_id for r in unique.values() if isinstance(r.event, (RunStarted, RunFinished))
    )
    async with conn.transaction():
        await conn.execute(_CREATE_STAGING)
        await conn.copy_records_to_table(
            _STAGING,
            columns=_EVENT_COLUMNS,
            records=[
                (e.event_id, event_kind(e), subject, e.model, e.node, _time(e.ts), ledger_json(e), seq)
                for subject, e, seq in unique.values()
            ],
        )
        stale = int((await conn.execute(_INSERT_NEW)).split()[-1])
        if stale < len(unique):
            await _apply(conn, _LIVE, kinds, max(per_request.values(), default=0))
            for notice_kinds, notice in _LIVE.notices:
                if kinds & notice_kinds:
                    await conn.execute(notice)
    return len(unique) - stale


async def rebuild(conn: asyncpg.Connection) -> dict[str, int]:
    """Recompute every projection from `events` in one transaction; returns the row count of each.

    Readers and recording recorders wait for the commit, so nobody sees half-built projections.
    """
    async with conn.transaction():
        # Taken before the projections, in the same order a recorder's batch takes its locks.
        await conn.execute("LOCK TABLE events IN SHARE MODE")
        await conn.execute(f"TRUNCATE {', '.join(PROJECTIONS)}")
        await _apply(conn, _ALL, set(_ALL.by_kind), await conn.fetchval(_ALL.max_rounds))
        return {table: await conn.fetchval(f"SELECT count(*) FROM {table}") for table in PROJECTIONS}

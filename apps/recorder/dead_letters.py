"""The dead-letter table: where an event goes that cannot be recorded, so it never blocks the stream.

Two reasons: the message does not decode as an event (`undecodable`), or PostgreSQL refused to
record it (`rejected`: a bad value, a violated constraint, an index row too large, any error that
is about this event's data). The raw message body is kept with the error and its stream sequence,
so nothing is lost silently and an operator can look at it, fix the cause and replay it. A message
met twice (redelivered, or replayed by `--rebuild`) keeps one row.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from enum import StrEnum

import asyncpg

_TEXT_LIMIT = 4000


class Reason(StrEnum):
    UNDECODABLE = "undecodable"
    REJECTED = "rejected"


@dataclass(slots=True, frozen=True)
class DeadLetter:
    reason: Reason
    subject: str
    payload: bytes
    error: str
    stream_seq: int | None = None
    event_id: str | None = None
    kind: str | None = None
    sqlstate: str | None = None


def _text(value: str | None) -> str | None:
    # PostgreSQL text holds no NUL; the payload (bytea) keeps the original bytes.
    return None if value is None else value.replace("\x00", "\\u0000")[:_TEXT_LIMIT]


def kind_from_subject(subject: str) -> str | None:
    """`helexa.events.<kind>.<model>` → kind (for a message whose body says nothing readable); kinds
    may hold dots (`run.started`), model tokens never do."""
    parts = subject.split(".")
    return ".".join(parts[2:-1]) if len(parts) >= 4 and parts[:2] == ["helexa", "events"] else None


_INSERT = """
INSERT INTO dead_letters (stream_seq, subject, event_id, kind, reason, sqlstate, error, payload, payload_sha256)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (stream_seq, payload_sha256) DO NOTHING
"""


async def store(conn: asyncpg.Connection, letter: DeadLetter) -> bool:
    """Keep one dead letter (its own statement, outside any batch); False if it was already kept."""
    status = await conn.execute(
        _INSERT, letter.stream_seq, _text(letter.subject) or "", _text(letter.event_id), _text(letter.kind),
        letter.reason.value, letter.sqlstate, _text(letter.error) or "", letter.payload,
        hashlib.sha256(letter.payload).digest(),
    )
    return status.split()[-1] == "1"

"""The SQL side of the recorder: a batch of events into `events`, and from there into the projections.

One transaction per batch. Raw events are copied into a staging table and inserted with
ON CONFLICT DO NOTHING; only the events that this insert actually added are projected, so a
redelivered event is a no-op and at-least-once delivery yields exactly-once rows.

`runs` merges run.started and run.finished whatever order they arrive in: a row describes the
request's latest attempt, run.finished of an attempt wins over its run.started, and `started_at`
is the earliest start seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

import asyncpg

from apps.bus.wire import Event, RunFinished, RunStarted, encode

RUNNING = "running"

_EVENT_COLUMNS = ("event_id", "kind", "subject", "model", "node", "ts", "payload")

# The staging table lives for the session and is emptied at every commit.
_CREATE_STAGING = """
CREATE TEMP TABLE IF NOT EXISTS incoming_events (LIKE events INCLUDING DEFAULTS) ON COMMIT DELETE ROWS
"""

_INSERT_NEW = f"""
INSERT INTO events ({", ".join(_EVENT_COLUMNS)})
SELECT {", ".join(_EVENT_COLUMNS)} FROM incoming_events ORDER BY event_id
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id
"""

# Everything about a run except its identity and first start belongs to one attempt.
_ATTEMPT_COLUMNS = (
    "model", "node", "principal", "api", "status", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens",
    "queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "e2e_ms",
    "attempt", "error", "finished_at",
)  # fmt: skip


def _upsert_run(columns: tuple[str, ...], supersedes: str) -> str:
    """An upsert of `columns` that replaces the attempt's columns only when `supersedes` holds.

    Attempt columns the statement does not set are NULL in EXCLUDED, so a newer attempt's
    start clears the previous attempt's outcome.
    """
    values = ", ".join(f"${i}" for i in range(1, len(columns) + 1))
    take = ",\n    ".join(f"{c} = CASE WHEN {supersedes} THEN EXCLUDED.{c} ELSE r.{c} END" for c in _ATTEMPT_COLUMNS)
    return f"""
INSERT INTO runs AS r ({", ".join(columns)}) VALUES ({values})
ON CONFLICT (request_id) DO UPDATE SET
    {take},
    started_at = LEAST(r.started_at, EXCLUDED.started_at),
    updated_at = now()
"""


_STARTED_COLUMNS = (
    "request_id", "model", "node", "principal", "api", "status",
    "prompt_tokens", "queue_ms", "attempt", "started_at",
)  # fmt: skip
_FINISHED_COLUMNS = (
    "request_id", "model", "node", "principal", "api", "status", "finish_reason",
    "prompt_tokens", "completion_tokens", "cached_tokens", "queue_ms", "ttft_ms",
    "prefill_ms", "decode_ms", "e2e_ms", "attempt", "error", "finished_at",
)  # fmt: skip

_UPSERT_STARTED = _upsert_run(_STARTED_COLUMNS, "EXCLUDED.attempt > r.attempt")
_UPSERT_FINISHED = _upsert_run(_FINISHED_COLUMNS, "EXCLUDED.attempt >= r.attempt")


def _time(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, UTC)


def event_kind(event: Event) -> str:
    return type(event).__struct_config__.tag


def _started_row(e: RunStarted) -> tuple:
    return (e.request_id, e.model, e.node, e.principal, e.api, RUNNING, e.prompt_tokens, e.queue_ms, e.attempt, _time(e.ts))


def _finished_row(e: RunFinished) -> tuple:
    return (
        e.request_id, e.model, e.node, e.principal, e.api, e.status, e.finish_reason,
        e.prompt_tokens, e.completion_tokens, e.cached_tokens, e.queue_ms, e.ttft_ms,
        e.prefill_ms, e.decode_ms, e.e2e_ms, e.attempt, e.error, _time(e.ts),
    )  # fmt: skip


async def project(conn: asyncpg.Connection, batch: Sequence[tuple[str, Event]]) -> int:
    """Record `(subject, event)` pairs in one transaction; returns how many events were new."""
    unique = {event.event_id: (subject, event) for subject, event in batch}
    if not unique:
        return 0
    async with conn.transaction():
        await conn.execute(_CREATE_STAGING)
        await conn.copy_records_to_table(
            "incoming_events",
            columns=_EVENT_COLUMNS,
            records=[
                (e.event_id, event_kind(e), subject, e.model, e.node, _time(e.ts), encode(e).decode())
                for subject, e in unique.values()
            ],
        )
        fresh = [unique[row["event_id"]][1] for row in await conn.fetch(_INSERT_NEW)]
        # Sorted so concurrent recorders lock rows in the same order.
        fresh.sort(key=lambda e: getattr(e, "request_id", ""))
        started = [_started_row(e) for e in fresh if isinstance(e, RunStarted)]
        finished = [_finished_row(e) for e in fresh if isinstance(e, RunFinished)]
        if started:
            await conn.executemany(_UPSERT_STARTED, started)
        if finished:
            await conn.executemany(_UPSERT_FINISHED, finished)
    return len(fresh)

"""The projector against a real PostgreSQL: exact rows whatever the duplicates and arrival order."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from apps.bus.topology import event_subject
from apps.bus.wire import Event
from apps.recorder.migrate import migrate
from apps.recorder.projector import event_kind, project
from tests.recorder.conftest import finished, started


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    await migrate(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


def _batch(*events: Event) -> list[tuple[str, Event]]:
    return [(event_subject(event_kind(e), e.model), e) for e in events]


async def test_duplicates_are_recorded_once(conn: asyncpg.Connection) -> None:
    start, finish = started("r1"), finished("r1")
    assert await project(conn, _batch(start, start, finish)) == 2
    assert await project(conn, _batch(finish, start)) == 0
    assert await conn.fetchval("SELECT count(*) FROM events") == 2
    row = await conn.fetchrow("SELECT * FROM runs")
    assert (row["request_id"], row["status"], row["completion_tokens"]) == ("r1", "ok", 7)
    raw = await conn.fetchrow("SELECT kind, subject, payload FROM events WHERE event_id = $1", start.event_id)
    assert raw["kind"] == "run.started"
    assert raw["subject"] == "helexa.events.run.started.tiny"
    assert '"request_id": "r1"' in raw["payload"]


@pytest.mark.parametrize("order", ["started_first", "finished_first", "same_batch"])
async def test_started_and_finished_merge_in_any_order(conn: asyncpg.Connection, order: str) -> None:
    start = started("r2", ts=1_700_000_000.0)
    finish = finished("r2", ts=1_700_000_001.0, node="node-a", status="error", finish_reason="error", error="boom")
    if order == "same_batch":
        await project(conn, _batch(finish, start))
    else:
        first, second = (start, finish) if order == "started_first" else (finish, start)
        await project(conn, _batch(first))
        await project(conn, _batch(second))
    row = await conn.fetchrow("SELECT * FROM runs WHERE request_id = 'r2'")
    assert row["status"] == "error" and row["finish_reason"] == "error" and row["error"] == "boom"
    assert row["started_at"].timestamp() == 1_700_000_000.0
    assert row["finished_at"].timestamp() == 1_700_000_001.0
    assert (row["prompt_tokens"], row["completion_tokens"], row["cached_tokens"]) == (12, 7, 4)
    assert (row["ttft_ms"], row["e2e_ms"], row["attempt"], row["principal"]) == (20.0, 63.0, 1, "alice")
    assert await conn.fetchval("SELECT count(*) FROM runs") == 1


async def test_started_alone_is_running(conn: asyncpg.Connection) -> None:
    await project(conn, _batch(started("r3")))
    row = await conn.fetchrow("SELECT status, finished_at, attempt FROM runs WHERE request_id = 'r3'")
    assert tuple(row) == ("running", None, 1)


async def test_a_later_attempt_supersedes_an_earlier_one(conn: asyncpg.Connection) -> None:
    first = started("r4", node="node-a", attempt=1, ts=100.0)
    retry = started("r4", node="node-b", attempt=2, ts=105.0)
    done = finished("r4", node="node-b", attempt=2, ts=110.0)
    # The retry's outcome arrives first and the first attempt's start last.
    await project(conn, _batch(done))
    await project(conn, _batch(retry))
    await project(conn, _batch(first))
    row = await conn.fetchrow("SELECT node, attempt, status, started_at, finished_at FROM runs")
    assert (row["node"], row["attempt"], row["status"]) == ("node-b", 2, "ok")
    assert (row["started_at"].timestamp(), row["finished_at"].timestamp()) == (100.0, 110.0)


async def test_a_retry_starting_clears_the_previous_attempts_outcome(conn: asyncpg.Connection) -> None:
    await project(conn, _batch(finished("r5", attempt=1, status="error", finish_reason="error", error="lost")))
    await project(conn, _batch(started("r5", node="node-b", attempt=2)))
    row = await conn.fetchrow("SELECT node, attempt, status, finish_reason, error, finished_at FROM runs")
    assert tuple(row) == ("node-b", 2, "running", None, None, None)

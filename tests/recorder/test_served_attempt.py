"""`runs` follows the attempt that served the client; `run_attempts` keeps every attempt.

Two workers held one request: the first went silent, the second took over, the first resumed.
Whatever order the events of both attempts arrive in (one batch, one per batch, all at once) and
after a rebuild, the ledger says the same thing: which attempt served, and what each one did.
"""

from __future__ import annotations

import itertools

import asyncpg
import pytest

from apps.bus.events import Event
from apps.recorder.projector import project, rebuild
from tests.recorder.conftest import finished, on_subjects, started

T0 = 1_700_000_000.0




def _taken_over(first_serves: bool) -> list[Event]:
    """Attempt 1 on node-a, attempt 2 on node-b; one of them served, the other lost."""
    served, lost = ("node-a", "node-b") if first_serves else ("node-b", "node-a")
    attempt = {"node-a": 1, "node-b": 2}
    return [
        started("r", ts=T0, node="node-a", attempt=1),
        started("r", ts=T0 + 10, node="node-b", attempt=2),
        finished("r", ts=T0 + 11 if first_serves else T0 + 20, node=served, attempt=attempt[served],
                 completion_tokens=50, served=True),
        finished("r", ts=T0 + 21 if first_serves else T0 + 22, node=lost, attempt=attempt[lost],
                 status="cancelled", finish_reason="abort", completion_tokens=3, served=False),
    ]  # fmt: skip


async def _ledger(conn: asyncpg.Connection) -> tuple[tuple, list[tuple]]:
    run = tuple(await conn.fetchrow("SELECT * FROM runs"))
    attempts = [tuple(r) for r in await conn.fetch("SELECT * FROM run_attempts ORDER BY attempt")]
    return run, attempts


async def _reset(conn: asyncpg.Connection) -> None:
    await conn.execute("TRUNCATE events, runs, run_attempts")


@pytest.mark.parametrize("first_serves", [True, False], ids=["first-attempt-served", "second-attempt-served"])
async def test_runs_names_the_served_attempt_in_every_arrival_order(conn: asyncpg.Connection,
                                                                    first_serves: bool) -> None:
    events = _taken_over(first_serves)
    await project(conn, on_subjects(*events))
    expected = await _ledger(conn)
    row = await conn.fetchrow("SELECT * FROM runs")
    served = 1 if first_serves else 2
    assert ((row["served_attempt"], row["attempt"], row["status"], row["completion_tokens"])
            == (served, served, "ok", 50))
    assert row["node"] == ("node-a" if first_serves else "node-b")
    assert row["started_at"].timestamp() == T0 and row["last_event_at"].timestamp() == T0 + (21 if first_serves else 22)
    attempts = await conn.fetch("SELECT attempt, node, status, served FROM run_attempts ORDER BY attempt")
    assert [tuple(a) for a in attempts] == (
        [(1, "node-a", "ok", True), (2, "node-b", "cancelled", False)] if first_serves
        else [(1, "node-a", "cancelled", False), (2, "node-b", "ok", True)]
    )  # fmt: skip

    for order in itertools.permutations(events):
        await _reset(conn)
        for event in order:  # one batch per event: each arrives after the others committed
            await project(conn, on_subjects(event))
        assert await _ledger(conn) == expected, [type(e).__name__ + str(e.attempt) for e in order]
    for split in range(1, len(events)):
        await _reset(conn)
        await project(conn, on_subjects(*events[split:], *events[split:]))  # with duplicates
        await project(conn, on_subjects(*events[:split]))
        assert await _ledger(conn) == expected

    await conn.execute("UPDATE runs SET status = 'bogus'; DELETE FROM run_attempts")
    await rebuild(conn)
    assert await _ledger(conn) == expected


async def test_without_a_served_flag_the_latest_attempt_describes_the_run(conn: asyncpg.Connection) -> None:
    # Events from publishers that do not say which attempt served (served=None): as before.
    await project(conn, on_subjects(finished("old", attempt=2, ts=T0 + 5, node="node-b"),
                               finished("old", attempt=1, ts=T0 + 9, status="error", finish_reason="error")))
    row = await conn.fetchrow("SELECT attempt, node, status, served_attempt FROM runs")
    assert tuple(row) == (2, "node-b", "ok", None)
    assert await conn.fetchval("SELECT count(*) FROM run_attempts WHERE served IS NULL") == 2


async def test_a_started_retry_shows_running_until_an_attempt_serves(conn: asyncpg.Connection) -> None:
    await project(conn, on_subjects(started("r2", ts=T0), finished("r2", ts=T0 + 1, served=False, status="error",
                                                               finish_reason="error", error="worker_lost")))
    await project(conn, on_subjects(started("r2", ts=T0 + 2, attempt=2, node="node-b")))
    assert tuple(await conn.fetchrow("SELECT attempt, status, served_attempt FROM runs")) == (2, "running", None)
    await project(conn, on_subjects(finished("r2", ts=T0 + 3, attempt=2, node="node-b", served=True)))
    assert tuple(await conn.fetchrow("SELECT attempt, status, served_attempt FROM runs")) == (2, "ok", 2)


async def test_two_finishes_of_one_attempt_settle_on_the_same_one_in_any_order(conn: asyncpg.Connection) -> None:
    # The gateway reports the attempt lost; the worker, only silent, reports its own finish later.
    lost = finished("r3", ts=T0 + 30, status="error", finish_reason="error", error="worker_lost", node="gateway")
    own = finished("r3", ts=T0 + 31, status="ok")
    results = []
    for order in ((lost, own), (own, lost)):
        await _reset(conn)
        for event in order:
            await project(conn, on_subjects(event))
        results.append(await _ledger(conn))
    assert results[0] == results[1]

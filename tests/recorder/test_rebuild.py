"""`helexa recorder --rebuild`: the projections come back identical, from the table or from the stream alone."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable

import asyncpg
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER
from apps.embedded.nats_server import NatsServer
from apps.recorder.projector import PROJECTIONS
from apps.settings import RecorderSettings
from tests.recorder.conftest import LogWatch, publish_fast, recording, snapshot, wait_all_acked, wait_rows
from tests.recorder.workload import assert_projections, mixed
from tests.support import AppProcess

_RAW_EVENTS = "SELECT event_id, kind, subject, model, node, ts, payload, stream_seq FROM events ORDER BY event_id"


async def _raw_events(url: str) -> list[tuple]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch(_RAW_EVENTS)]
    finally:
        await conn.close()


def _rebuild(nats_url: str, database_url: str) -> tuple[AppProcess, dict]:
    """`helexa recorder --rebuild` as a child; returns it running and its `rebuild finished` line."""
    app = AppProcess(["recorder", "--rebuild"], env={"NATS_URL": nats_url, "DATABASE_URL": database_url})
    try:
        done = app.wait_for(lambda e: e.get("event") == "rebuild finished", 60)
        app.wait_ready(30)
    except BaseException:
        app.kill()
        raise
    return app, done


async def _drift(url: str) -> None:
    """Projections that no longer match the events, as after a projection bug."""
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("UPDATE runs SET status = 'bogus', completion_tokens = -1 WHERE request_id LIKE '%1'")
        await conn.execute("DELETE FROM admission_events WHERE decision = 'timeout'")
        await conn.execute("DELETE FROM bench_runs")
        await conn.execute(
            "INSERT INTO scores VALUES ('stray', now(), 'nope', 'tiny', 'bench', 'chat:1', 'x', 1, NULL, 'me')"
        )
    finally:
        await conn.close()


async def test_rebuild_reproduces_identical_projections(
    own_nats: NatsServer,
    nc: NatsClient,
    js: JetStreamContext,
    new_database: Callable[[], Awaitable[str]],
    log_watch: LogWatch,
) -> None:
    workload = mixed(num_requests=600, seed=9)
    sent = workload.with_duplicates(60, random.Random(2))
    await publish_fast(nc, sent)
    url = await new_database()
    async with recording(RecorderSettings(nats_url=own_nats.url, database_url=url), log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await wait_rows(url, "events", workload.counts["events"])
        await wait_all_acked(js)
    await assert_projections(url, workload)
    recorded = await snapshot(url)
    raw = await _raw_events(url)
    await _drift(url)
    assert await snapshot(url) != recorded

    # From the events table (the stream replay finds nothing new).
    app, done = _rebuild(own_nats.url, url)
    try:
        assert done["rows"] == {t: workload.counts[t] for t in PROJECTIONS}
        assert (done["replayed"], done["recorded"]) == (len(sent), 0)
        assert await snapshot(url) == recorded
        assert await _raw_events(url) == raw
    finally:
        app.stop()

    # From the stream alone, into a database that never saw these events.
    empty = await new_database()
    app, done = _rebuild(own_nats.url, empty)
    try:
        assert done["rows"] == {t: 0 for t in PROJECTIONS}
        assert (done["replayed"], done["recorded"]) == (len(sent), workload.counts["events"])
        assert await snapshot(empty) == recorded
        assert await _raw_events(empty) == raw
    finally:
        app.stop()

    consumers = [c.name for c in await js.consumers_info(EVENTS_STREAM)]
    assert consumers == [RECORDER_CONSUMER]

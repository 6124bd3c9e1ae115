"""`helexa recorder --rebuild`: the projections come back identical, from the table or from the stream alone."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Awaitable, Callable

import asyncpg
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from apps.bus.events import ResponseDeleted, ResponseStored
from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER
from apps.embedded.nats_server import NatsServer
from apps.recorder import app
from apps.recorder.projections import PROJECTIONS
from apps.settings import RecorderSettings
from tests.recorder.conftest import (
    LogWatch,
    finished,
    publish,
    publish_fast,
    recording,
    snapshot,
    started,
    wait_all_acked,
    wait_rows,
)
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

    # A deleted response's stored event (the copy the ledger recorded) left the stream with its deletion.
    deleted = {e.response_id for e in sent if isinstance(e, ResponseDeleted)}
    erased = [e for e in sent if isinstance(e, ResponseStored) and e.response_id in deleted]
    assert erased
    on_stream = len(sent) - len({e.event_id for e in erased})

    # From the events table (the stream replay finds nothing new).
    app, done = _rebuild(own_nats.url, url)
    try:
        assert done["rows"] == {t: workload.counts[t] for t in PROJECTIONS}
        assert (done["replayed"], done["recorded"]) == (on_stream, 0)
        assert await snapshot(url) == recorded
        assert await _raw_events(url) == raw
    finally:
        app.stop()

    # From the stream alone, into a database that never saw these events: the same, except for the
    # erased events with no other copy on the stream, whose responses are known by their deletions only
    # (a duplicate copy comes back with its content erased again, under its own stream sequence).
    empty = await new_database()
    app, done = _rebuild(own_nats.url, empty)
    copies = Counter(e.event_id for e in sent)
    gone = {e.event_id for e in erased if copies[e.event_id] == 1}
    unknown = {e.response_id for e in erased} - {e.response_id for e in erased if e.event_id not in gone}
    try:
        assert done["rows"] == {t: 0 for t in PROJECTIONS}
        assert (done["replayed"], done["recorded"]) == (on_stream, workload.counts["events"] - len(gone))
        expected = {**recorded, "responses": [
            (row[0], *([None] * 5), *row[6:]) if row[0] in unknown else row for row in recorded["responses"]]}
        assert await snapshot(empty) == expected
        assert [row[:7] for row in await _raw_events(empty)] == [row[:7] for row in raw if row[0] not in gone]
    finally:
        app.stop()

    consumers = [c.name for c in await js.consumers_info(EVENTS_STREAM)]
    assert consumers == [RECORDER_CONSUMER]


async def test_a_replay_whose_consumer_the_server_removed_goes_on_from_where_it_got_to(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A ledger outage longer than the replay consumer's inactive threshold has the server remove
    # it: the replay makes a new one from the next sequence, and replays the whole stream.
    ids = [f"replayed-{i}" for i in range(10)]
    await publish(js, *(started(i) for i in ids), *(finished(i) for i in ids))
    monkeypatch.setattr(app, "REPLAY_BATCH", 5)
    record, removed = app.Recorder.record, []

    async def record_then_lose_the_consumer(self: app.Recorder, pending: app.Pending, acks: bool = True) -> int:
        if not acks and not removed:
            for info in await js.consumers_info(EVENTS_STREAM):
                if info.name.startswith(f"{RECORDER_CONSUMER}-replay-"):
                    await js.delete_consumer(EVENTS_STREAM, info.name)
                    removed.append(info.name)
        return await record(self, pending, acks)

    monkeypatch.setattr(app.Recorder, "record", record_then_lose_the_consumer)
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url)
    async with recording(settings, log_watch, rebuild=True) as task:
        done = await log_watch.wait_for("rebuild finished", task=task)
    assert removed and log_watch.matching("replay goes on with a new consumer", from_seq=6)
    assert (done.replayed, done.recorded) == (20, 20)

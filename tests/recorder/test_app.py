"""The recorder end to end: real NATS, real PostgreSQL, duplicates, garbage and outages."""

from __future__ import annotations

import asyncio
import secrets
import uuid

import asyncpg
import msgspec
from nats.js import JetStreamContext

from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER, event_subject
from apps.bus.wire import encode
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.settings import RecorderSettings
from tests.recorder.conftest import LogWatch, fetchval, finished, publish, recording, started, wait_all_acked
from tests.support import eventually_async


def _settings(own_nats: NatsServer, url: str) -> RecorderSettings:
    return RecorderSettings(nats_url=own_nats.url, database_url=url, batch_size=64)


async def test_redelivered_and_reordered_events_become_exact_rows(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    start, finish = started("req-1", ts=1_700_000_000.0), finished("req-1", ts=1_700_000_002.0)
    other = started("req-2")
    await publish(js, finish, start, finish, start, other)
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 5

    async with recording(_settings(own_nats, database_url), log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await eventually_async(lambda: _is(database_url, "SELECT count(*) FROM events", 3), 20.0, message="3 events")
        await wait_all_acked(js)
        # A late duplicate, after the first copies were committed and acked.
        await publish(js, finish)
        await wait_all_acked(js)

    assert await fetchval(database_url, "SELECT count(*) FROM events") == 3
    assert await fetchval(database_url, "SELECT count(*) FROM runs") == 2
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT * FROM runs WHERE request_id = 'req-1'")
    finally:
        await conn.close()
    assert (row["status"], row["finish_reason"], row["completion_tokens"]) == ("ok", "stop", 7)
    assert row["started_at"].timestamp() == 1_700_000_000.0
    assert row["finished_at"].timestamp() == 1_700_000_002.0


async def _is(url: str, sql: str, expected: int) -> bool:
    return await fetchval(url, sql) == expected


async def test_events_arriving_while_a_batch_lingers_commit_with_it(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    """A batch that is not full waits for the rest of its burst: an event published after the
    first was fetched is written in the first one's transaction (one commit per burst)."""
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url, batch_size=64, linger_ms=3000)
    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await publish(js, started("req-1"))

        async def first_fetched() -> bool:
            return (await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)).num_ack_pending == 1

        await eventually_async(first_fetched, 20.0, message="the first event fetched")
        await publish(js, started("req-2"))
        await eventually_async(lambda: _is(database_url, "SELECT count(*) FROM events", 2), 20.0, message="2 events")
        await wait_all_acked(js)
    assert await fetchval(database_url, "SELECT count(DISTINCT xmin::text) FROM events") == 1


async def test_undecodable_and_rejected_events_do_not_block_the_stream(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    await js.publish(event_subject("run.started", "tiny"), b"not json")
    await js.publish(event_subject("run.started", "tiny"), b'{"kind": "run.started", "model": "tiny"}')
    # Complete but for its id: the wire default would give every delivery a new one, and duplicate rows.
    anonymous = msgspec.json.decode(encode(started("req-no-id")))
    del anonymous["event_id"]
    await js.publish(event_subject("run.started", "tiny"), msgspec.json.encode(anonymous))
    # Decodes fine, but PostgreSQL refuses it: a request id past what a btree index row holds.
    poison = started("req-poison-" + secrets.token_hex(5000))
    # A NUL, which jsonb cannot hold, is recorded as U+FFFD rather than refused.
    nul = started("req-nul", principal="nul\x00byte")
    good = [started(f"req-{i}") for i in range(5)]
    await publish(js, *good[:2], poison, nul, *good[2:])

    async with recording(_settings(own_nats, database_url), log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await eventually_async(lambda: _is(database_url, "SELECT count(*) FROM runs", 6), 20.0,
                               message="the good events")
        await wait_all_acked(js)

    assert len(log_watch.matching("event dead-lettered", reason="undecodable")) == 3
    assert len(log_watch.matching("event dead-lettered", reason="rejected")) == 1
    assert await fetchval(database_url, "SELECT count(*) FROM events") == 6
    assert await fetchval(database_url, "SELECT count(*) FROM runs WHERE request_id LIKE 'req-poison%'") == 0
    assert await fetchval(database_url, "SELECT principal FROM runs WHERE request_id = 'req-nul'") == "nul\ufffdbyte"
    conn = await asyncpg.connect(database_url)
    try:
        letters = await conn.fetch("SELECT * FROM dead_letters ORDER BY stream_seq")
    finally:
        await conn.close()
    assert [(r["stream_seq"], r["reason"]) for r in letters] == [
        (1, "undecodable"), (2, "undecodable"), (3, "undecodable"), (6, "rejected")]
    assert letters[0]["payload"] == b"not json" and letters[0]["kind"] == "run.started"
    assert letters[3]["event_id"] == poison.event_id and letters[3]["sqlstate"] is not None
    assert msgspec.json.decode(letters[3]["payload"])["request_id"] == poison.request_id


async def test_started_before_postgres_records_everything_once_it_is_up(
    own_nats: NatsServer, js: JetStreamContext, own_postgres: PostgresServer, log_watch: LogWatch
) -> None:
    ids = [f"req-{uuid.uuid4().hex[:8]}" for _ in range(20)]
    await publish(js, *(started(i) for i in ids), *(finished(i) for i in ids))

    async with recording(_settings(own_nats, own_postgres.url), log_watch) as task:
        await log_watch.wait_for("postgres unavailable, retrying", task=task, during="migrate")
        await asyncio.to_thread(own_postgres.start)
        await log_watch.wait_for("ready", task=task)
        await eventually_async(lambda: _is(own_postgres.url, "SELECT count(*) FROM events", 40), 20.0,
                               message="40 events")
        await wait_all_acked(js)

    assert await fetchval(own_postgres.url, "SELECT count(*) FROM runs WHERE status = 'ok'") == 20


async def test_an_outage_mid_stream_holds_the_batch_and_retries_it(
    own_nats: NatsServer, js: JetStreamContext, own_postgres: PostgresServer, log_watch: LogWatch
) -> None:
    await asyncio.to_thread(own_postgres.start)
    async with recording(_settings(own_nats, own_postgres.url), log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await publish(js, started("before"))
        await eventually_async(lambda: _is(own_postgres.url, "SELECT count(*) FROM runs", 1), 20.0,
                               message="the first run")

        await asyncio.to_thread(own_postgres.stop)
        await publish(js, finished("before"), started("during"), finished("during"))
        await log_watch.wait_for("postgres unavailable, retrying", task=task, during="write")
        info = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
        # Held in hand or still queued: neither acked nor lost.
        assert info.num_ack_pending >= 1
        assert info.num_ack_pending + info.num_pending == 3

        await asyncio.to_thread(own_postgres.start)
        await eventually_async(lambda: _is(own_postgres.url, "SELECT count(*) FROM events", 4), 20.0,
                               message="4 events")
        await wait_all_acked(js)

    assert await fetchval(own_postgres.url, "SELECT count(*) FROM runs WHERE status = 'ok'") == 2


async def test_a_lock_the_write_may_not_wait_for_is_waited_out_and_a_hung_write_is_ended(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    # A DBA's lock_timeout makes a write that meets a held lock fail with 55P03, which no event
    # causes: the batch is held and written once the lock goes, and nothing is dead-lettered. Without
    # lock_timeout the same lock hangs the write, which is ended at half the ack wait and retried.
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url, batch_size=64, ack_wait_s=2.0)
    holder = await asyncpg.connect(database_url)
    try:
        database = await holder.fetchval("SELECT current_database()")
        for lock_timeout, logged in (("100ms", "postgres failed the write for a reason no event causes, retrying"),
                                     ("0", "postgres unavailable, retrying")):
            # Each recorder's connections are new, so they take the database's setting of the moment.
            await holder.execute(f"ALTER DATABASE \"{database}\" SET lock_timeout = '{lock_timeout}'")
            request_id = f"locked-{lock_timeout}"
            log_watch.records.clear()
            async with recording(settings, log_watch) as task:
                await log_watch.wait_for("ready", task=task)
                async with holder.transaction():
                    await holder.execute("LOCK TABLE runs IN ACCESS EXCLUSIVE MODE")
                    await publish(js, started(request_id), finished(request_id))
                    failed = await log_watch.wait_for(logged, task=task, during="write")
                    if lock_timeout != "0":
                        assert failed.sqlstate == "55P03"
                    else:
                        assert "WriteTimedOut" in failed.error
                    info = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
                    assert info.num_ack_pending + info.num_pending == 2  # held, not settled
                await eventually_async(
                    lambda rid=request_id: _is(database_url, f"SELECT count(*) FROM runs WHERE request_id = '{rid}' "
                                                             "AND status = 'ok'", 1), 20.0, message="the held run")
                await wait_all_acked(js)
    finally:
        await holder.close()
    assert await fetchval(database_url, "SELECT count(*) FROM dead_letters") == 0

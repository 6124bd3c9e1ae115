"""The recorder killed mid-batch, and PostgreSQL gone mid-stream: nothing lost, nothing doubled."""

from __future__ import annotations

import asyncio
import random

import asyncpg
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.settings import RecorderSettings
from tests.recorder.conftest import LogWatch, publish_fast, recording, wait_all_acked, wait_rows
from tests.recorder.workload import assert_projections, mixed
from tests.support import AppProcess, eventually_async


def _recorder(nats_url: str, database_url: str) -> AppProcess:
    return AppProcess(
        ["recorder"],
        env={
            "NATS_URL": nats_url,
            "DATABASE_URL": database_url,
            "HELEXA_RECORDER_BATCH": "50",
            # The killed recorder's batch comes back this soon.
            "HELEXA_RECORDER_ACK_WAIT_S": "2",
        },
    )


async def _blocked_on_lock(conn: asyncpg.Connection, database_url: str) -> bool:
    waiting = await conn.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND wait_event_type = 'Lock'",
        database_url.rsplit("/", 1)[1],
    )
    return waiting > 0


async def test_killed_mid_batch_then_restarted(
    own_nats: NatsServer, nc: NatsClient, js: JetStreamContext, database_url: str
) -> None:
    workload = mixed(num_requests=1000, seed=3)
    sent = workload.with_duplicates(100, random.Random(5))
    early, late = sent[:1500], sent[1500:]
    await publish_fast(nc, early)

    first = _recorder(own_nats.url, database_url)
    blocker = await asyncpg.connect(database_url)
    try:
        first.wait_ready(60)
        await wait_rows(database_url, "events", len({e.event_id for e in early}))
        await wait_all_acked(js)
        # Hold the recorder inside its next batch: its transaction waits on this lock, its messages unacked.
        blocking = blocker.transaction()
        await blocking.start()
        await blocker.execute("LOCK TABLE events IN SHARE ROW EXCLUSIVE MODE")
        await publish_fast(nc, late)
        await eventually_async(lambda: _blocked_on_lock(blocker, database_url), 20.0,
                               message="the recorder blocked mid-batch")
        held = (await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)).num_ack_pending
        first.kill()
        await blocking.rollback()
    finally:
        first.kill()
        await blocker.close()
    assert held >= 50  # at least the whole batch it was writing was in the dead recorder's hands

    second = _recorder(own_nats.url, database_url)
    try:
        second.wait_ready(60)
        await wait_rows(database_url, "events", workload.counts["events"])
        await wait_all_acked(js)
    finally:
        second.stop()
    await assert_projections(database_url, workload)


async def test_postgres_stopped_for_seconds_during_a_stream(
    own_nats: NatsServer, nc: NatsClient, js: JetStreamContext, own_postgres: PostgresServer, log_watch: LogWatch
) -> None:
    workload = mixed(num_requests=1000, seed=4)
    sent = workload.with_duplicates(200, random.Random(6))
    before, during, after = sent[:1000], sent[1000:2200], sent[2200:]
    await asyncio.to_thread(own_postgres.start)
    settings = RecorderSettings(nats_url=own_nats.url, database_url=own_postgres.url, batch_size=100)

    async def stream(events: list, every_s: float) -> None:
        for i in range(0, len(events), 100):
            await publish_fast(nc, events[i : i + 100])
            await asyncio.sleep(every_s)

    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await stream(before, 0.05)
        await wait_rows(own_postgres.url, "events", 300)
        await asyncio.to_thread(own_postgres.stop)
        # The outage lasts as long as this part of the stream: about three seconds.
        await stream(during, 0.25)
        await log_watch.wait_for("postgres unavailable, retrying", task=task, during="write")
        await asyncio.to_thread(own_postgres.start)
        await stream(after, 0.05)
        await wait_rows(own_postgres.url, "events", workload.counts["events"])
        await wait_all_acked(js)

    await assert_projections(own_postgres.url, workload)

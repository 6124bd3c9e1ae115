"""At-least-once delivery in, exactly-once rows out: duplicates and shuffled order change nothing."""

from __future__ import annotations

import random

from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from apps.bus.topology import EVENTS_STREAM
from apps.embedded.nats_server import NatsServer
from apps.settings import RecorderSettings
from tests.recorder.conftest import LogWatch, publish_fast, recording, wait_all_acked, wait_rows
from tests.recorder.workload import assert_projections, mixed


async def test_5000_events_with_500_duplicates_in_shuffled_order(
    own_nats: NatsServer, nc: NatsClient, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    workload = mixed(num_requests=1500)
    assert workload.counts["events"] == 4500
    sent = workload.with_duplicates(500, random.Random(11))
    await publish_fast(nc, sent)
    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 5000

    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url, batch_size=128)
    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await wait_rows(database_url, "events", 4500)
        await wait_all_acked(js)

    await assert_projections(database_url, workload)
    assert not log_watch.matching("event dead-lettered")

"""The recorder records an event only on its own kind's subject, whose publishers NATS permissions
pick (`apps.bus.roles`): another kind's body there is dead-lettered, never projected. So a worker,
which may publish run events, cannot forge a stored conversation by sending one on its subjects."""

from __future__ import annotations

import asyncpg
from nats.js import JetStreamContext

from apps.bus import topology
from apps.bus.codes import RunStatus
from apps.bus.wire import encode
from apps.embedded.nats_server import NatsServer
from apps.settings import RecorderSettings
from tests.recorder.conftest import (
    LogWatch,
    admission,
    fetchval,
    finished,
    publish,
    recording,
    response_stored,
    started,
    wait_all_acked,
)


async def test_an_event_on_another_kinds_subject_is_dead_lettered(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    forged = response_stored("resp_forged", principal="alice")
    # On the subjects a worker may publish to: run.started, and `dropped` (admissions, only dropped ones).
    await js.publish(topology.event_subject("run.started", "tiny"), encode(forged))
    await js.publish(topology.event_subject(topology.DROPPED, "tiny"), encode(admission("admitted-by-worker")))
    # A gateway's report of a lost worker's run says it failed; it cannot say it went well.
    await js.publish(topology.event_subject(topology.WORKER_LOST, "tiny"), encode(finished("lost-ok")))
    await js.publish(topology.event_subject(topology.WORKER_LOST, "tiny"),
                     encode(finished("lost", status=RunStatus.ERROR)))
    await js.publish(topology.event_subject(topology.DROPPED, "tiny"),
                     encode(admission("dropped", decision="timeout")))
    await publish(js, started("real"), finished("real"))
    settings = RecorderSettings(nats_url=own_nats.url_for("recorder"), database_url=database_url)
    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await wait_all_acked(js)
    conn = await asyncpg.connect(database_url)
    try:
        letters = [(r["subject"], r["reason"]) for r in await conn.fetch("SELECT * FROM dead_letters ORDER BY id")]
        runs = {r["request_id"]: r["status"] for r in await conn.fetch("SELECT request_id, status FROM runs")}
    finally:
        await conn.close()
    assert sorted(letters) == sorted([(topology.event_subject("run.started", "tiny"), "undecodable"),
                                      (topology.event_subject(topology.DROPPED, "tiny"), "undecodable"),
                                      (topology.event_subject(topology.WORKER_LOST, "tiny"), "undecodable")])
    assert await fetchval(database_url, "SELECT count(*) FROM responses") == 0
    assert runs == {"lost": "error", "real": "ok"}
    assert await fetchval(database_url, "SELECT request_id FROM admission_events") == "dropped"

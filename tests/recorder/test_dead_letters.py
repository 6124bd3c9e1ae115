"""One event that cannot be recorded goes to `dead_letters`; the recorder keeps recording the rest."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import asyncpg
import httpx
import msgspec
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.object_store import ObjectStore

from apps.bus import event_publish
from apps.bus.topology import EVENTS_STREAM, event_subject
from apps.bus.wire import encode
from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer
from apps.recorder import large_events
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
from tests.support import eventually_async


def _metric(text: str, name: str) -> float:
    """The value of one sample line `name value` in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not exposed:\n{text}")


async def _scrape(url: str) -> str:
    async with httpx.AsyncClient() as client:
        return (await client.get(url, timeout=5)).text


async def test_a_poison_event_is_dead_lettered_and_the_events_after_it_are_recorded(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    before = [started(f"before-{i}") for i in range(4)]
    # Random text too long for a btree index entry (~2.7 kB even after compression): PostgreSQL
    # refuses the `runs` row with program_limit_exceeded, a family the recorder had no answer for.
    poison = started("x" + secrets.token_urlsafe(12_000))
    after = [finished(f"before-{i}") for i in range(4)] + [admission("after-0")]
    await publish(js, *before, poison, *after)
    poison_seq = len(before) + 1
    port = free_port()
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url, batch_size=64,
                                metrics_port=port, watch_interval_s=0.2)
    metrics_url = f"http://127.0.0.1:{port}/metrics"

    async with recording(settings, log_watch) as task:
        ready = await log_watch.wait_for("ready", task=task)
        assert ready.metrics == metrics_url
        await wait_all_acked(js)
        # The recorder is still running, and records what comes after the poisoned batch too.
        later = [started("later"), finished("later")]
        await publish(js, *later)
        await eventually_async(lambda: _equals(database_url, "SELECT count(*) FROM runs WHERE status = 'ok'", 5),
                               20.0, message="the runs before and after the poison")
        await wait_all_acked(js)
        assert not task.done()

        async def lag_settled() -> bool:
            text = await _scrape(metrics_url)
            return (_metric(text, "helexa:recorder_lag_events") == 0
                    and _metric(text, "helexa:recorder_events_recorded_total") == 11)

        await eventually_async(lag_settled, 20.0, message="no lag and 11 events recorded, in the metrics")
        text = await _scrape(metrics_url)
        assert _metric(text, 'helexa:recorder_dead_letters_total{reason="rejected"}') == 1
        assert _metric(text, 'helexa:recorder_dead_letters_total{reason="undecodable"}') == 0

    conn = await asyncpg.connect(database_url)
    try:
        (letter,) = await conn.fetch("SELECT * FROM dead_letters")
        runs = {r["request_id"]: r["status"] for r in await conn.fetch("SELECT request_id, status FROM runs")}
    finally:
        await conn.close()
    assert (letter["reason"], letter["sqlstate"], letter["stream_seq"]) == ("rejected", "54000", poison_seq)
    assert letter["event_id"] == poison.event_id and letter["kind"] == "run.started"
    assert "index row" in letter["error"]
    assert msgspec.json.decode(letter["payload"])["request_id"] == poison.request_id
    assert runs == {**{f"before-{i}": "ok" for i in range(4)}, "later": "ok"}
    assert await fetchval(database_url, "SELECT count(*) FROM admission_events") == 1


async def test_an_event_time_no_timestamp_can_hold_is_dead_lettered_as_undecodable(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    far = msgspec.json.decode(encode(started("far-future")))
    far["ts"] = 1e300
    await js.publish(event_subject("run.started", "tiny"), msgspec.json.encode(far))
    await publish(js, started("fine"))
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url)

    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await wait_all_acked(js)

    assert await fetchval(database_url, "SELECT request_id FROM runs") == "fine"
    assert await fetchval(database_url, "SELECT reason FROM dead_letters WHERE stream_seq = 1") == "undecodable"


async def test_a_replay_meets_the_poison_again_and_keeps_one_dead_letter(
    own_nats: NatsServer, js: JetStreamContext, database_url: str, log_watch: LogWatch
) -> None:
    await publish(js, started("ok-1"), started("y" + secrets.token_urlsafe(12_000)), started("ok-2"))
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url)
    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await wait_all_acked(js)
    async with recording(settings, log_watch, rebuild=True) as task:
        await log_watch.wait_for("rebuild finished", task=task)

    assert (await js.stream_info(EVENTS_STREAM)).state.messages == 3
    assert await fetchval(database_url, "SELECT count(*) FROM dead_letters") == 1
    assert await fetchval(database_url, "SELECT count(*) FROM runs WHERE request_id IN ('ok-1', 'ok-2')") == 2


async def _equals(url: str, sql: str, expected: object) -> bool:
    return await fetchval(url, sql) == expected


@pytest.mark.parametrize("failing", ["timeout", "silence"])
async def test_an_event_whose_object_the_store_does_not_give_back_now_is_recorded_later_not_buried(
    own_nats: NatsServer, nc: NatsClient, database_url: str, log_watch: LogWatch, monkeypatch: pytest.MonkeyPatch,
    failing: str,
) -> None:
    """A response.stored past the server's max_payload goes by reference (its event in the Object
    Store). The store's first two reads fail, as during a NATS restart: with nats' timeout, or by
    never answering (the recorder's own bound on a read ends it). The recorder keeps running, hands
    the reference back, and records the event once a read succeeds."""
    large = response_stored("resp_large", input_items=[
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "z" * nc.max_payload}]}])
    assert await event_publish.publish_event(nc.jetstream(), large)
    reads = 0
    real_get_info = ObjectStore.get_info

    async def flaky_get_info(store: ObjectStore, name: str, *args: Any, **kwargs: Any) -> Any:
        nonlocal reads
        reads += 1
        if reads <= 2:
            if failing == "silence":
                await asyncio.Event().wait()
            raise nats.errors.TimeoutError
        return await real_get_info(store, name, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "get_info", flaky_get_info)
    monkeypatch.setattr(large_events, "OBJECT_READ_S", 0.5)
    settings = RecorderSettings(nats_url=own_nats.url, database_url=database_url, metrics_port=free_port(),
                                watch_interval_s=0.2)
    async with recording(settings, log_watch) as task:
        await log_watch.wait_for("ready", task=task)
        await eventually_async(lambda: _equals(database_url, "SELECT count(*) FROM responses", 1), 30.0,
                               message="the large response recorded")
        assert not task.done()
    assert reads == 3
    assert await fetchval(database_url, "SELECT count(*) FROM dead_letters") == 0

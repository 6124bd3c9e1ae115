"""Recorder test fixtures: a fresh database per test, events to publish, a running recorder, its logs."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext

from apps.bus import events, wire
from apps.bus.connection import connect
from apps.bus.declaration import ensure_topology
from apps.bus.topology import EVENTS_STREAM, RECORDER_CONSUMER, BusLimits, event_subject
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.recorder.app import run_recorder
from apps.recorder.migrate import migrate
from apps.recorder.projections import PROJECTIONS
from apps.settings import RecorderSettings
from tests.support import eventually_async


@pytest.fixture
async def new_database(postgres: PostgresServer) -> AsyncIterator[Callable[[], Awaitable[str]]]:
    """Makes empty databases on the session's PostgreSQL, dropped after the test; returns their URLs."""
    names: list[str] = []
    admin = await asyncpg.connect(postgres.url)

    async def create() -> str:
        name = f"recorder_{uuid.uuid4().hex[:12]}"
        await admin.execute(f'CREATE DATABASE "{name}"')
        names.append(name)
        return postgres.url.rsplit("/", 1)[0] + "/" + name

    try:
        yield create
        for name in names:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def database_url(new_database: Callable[[], Awaitable[str]]) -> str:
    """An empty database of its own on the session's PostgreSQL."""
    return await new_database()


@pytest.fixture
async def conn(database_url: str) -> AsyncIterator[asyncpg.Connection]:
    """A connection to a migrated database of the test's own (test_sql_examples overrides it for UTC)."""
    await migrate(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        yield conn
    finally:
        await conn.close()


def on_subjects(*sent: events.Event) -> list[tuple[str, events.Event]]:
    """Events with the subjects they are published on, as the projector takes them."""
    return [(event_subject(events.event_kind(e), e.model), e) for e in sent]


def started(request_id: str, **fields: Any) -> events.RunStarted:
    defaults: dict[str, Any] = dict(
        model="tiny", node="node-a", api="chat.completions", principal="alice",
        prompt_tokens=12, attempt=1, queue_ms=3.0,
    )  # fmt: skip
    return events.RunStarted(request_id=request_id, **{**defaults, **fields})


def finished(request_id: str, **fields: Any) -> events.RunFinished:
    defaults: dict[str, Any] = dict(
        model="tiny", node="node-a", api="chat.completions", principal="alice",
        status="ok", finish_reason="stop", prompt_tokens=12, completion_tokens=7, cached_tokens=4,
        attempt=1, queue_ms=3.0, ttft_ms=20.0, prefill_ms=15.0, decode_ms=40.0, e2e_ms=63.0,
    )  # fmt: skip
    return events.RunFinished(request_id=request_id, **{**defaults, **fields})


def preempted(request_id: str, **fields: Any) -> events.RunPreempted:
    defaults: dict[str, Any] = dict(
        model="tiny", node="node-a", reason="interactive_waiting", service_class="batch", tokens_kept=5,
    )  # fmt: skip
    return events.RunPreempted(request_id=request_id, **{**defaults, **fields})


def admission(request_id: str, **fields: Any) -> events.AdmissionDecided:
    defaults: dict[str, Any] = dict(
        model="tiny", node="gateway", principal="alice", decision="admitted", pending=1, in_flight=1, waited_ms=2.5,
    )  # fmt: skip
    return events.AdmissionDecided(request_id=request_id, **{**defaults, **fields})


def node_status(node: str, **fields: Any) -> events.NodeStatusChanged:
    defaults: dict[str, Any] = dict(
        model="tiny", status="ready", version="0.1.0", models=["tiny"], slots=16, free_slots=16, kv_usage=0.0,
    )  # fmt: skip
    return events.NodeStatusChanged(node=node, **{**defaults, **fields})


def bench_run(run_id: str, **fields: Any) -> events.BenchRunRecorded:
    defaults: dict[str, Any] = dict(
        model="tiny", node="bench", target="http://127.0.0.1:8000/v1", scenario="chat:128",
        config={"samples": 3}, started_at=1_700_000_000.0, finished_at=1_700_000_010.0,
        results={"ttft_ms": [20.0, 21.0, 25.0]},
    )  # fmt: skip
    return events.BenchRunRecorded(run_id=run_id, **{**defaults, **fields})


def score(run_id: str, metric: str, value: float, **fields: Any) -> events.ScoreRecorded:
    defaults: dict[str, Any] = dict(model="tiny", node="bench", scenario="chat:128", unit="ms", scorer="helexa-bench")
    return events.ScoreRecorded(run_id=run_id, metric=metric, value=value, **{**defaults, **fields})


def response_stored(response_id: str, **fields: Any) -> events.ResponseStored:
    defaults: dict[str, Any] = dict(
        model="tiny", node="gateway", principal="alice",
        input_items=[{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]}],
        response={"id": response_id, "object": "response", "status": "completed",
                  "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text",
                                                                                 "text": "hello"}]}]},
    )  # fmt: skip
    return events.ResponseStored(response_id=response_id, **{**defaults, **fields})


def response_deleted(response_id: str, **fields: Any) -> events.ResponseDeleted:
    defaults: dict[str, Any] = dict(model="tiny", node="gateway", principal="alice")
    return events.ResponseDeleted(response_id=response_id, **{**defaults, **fields})


@pytest.fixture
async def nc(own_nats: NatsServer) -> AsyncIterator[NatsClient]:
    """A client on an empty bus of the test's own, with the topology declared."""
    nc = await connect(own_nats.url, "recorder-test")
    await ensure_topology(nc.jetstream(), BusLimits())
    try:
        yield nc
    finally:
        await nc.close()


@pytest.fixture
def js(nc: NatsClient) -> JetStreamContext:
    return nc.jetstream()


async def publish(js: JetStreamContext, *sent: events.Event) -> None:
    # No Nats-Msg-Id: JetStream stores every copy, as a republish after a lost ack would.
    for event in sent:
        await js.publish(event_subject(events.event_kind(event), event.model), wire.encode(event))


async def publish_fast(nc: NatsClient, sent: list[events.Event]) -> None:
    """Core-NATS publishes (no per-message ack), then wait until the stream has taken every one
    (by sequence: the recorder removes deleted responses' events from the stream meanwhile)."""
    js = nc.jetstream()
    before = (await js.stream_info(EVENTS_STREAM)).state.last_seq
    for event in sent:
        await nc.publish(event_subject(events.event_kind(event), event.model), wire.encode(event))
    await nc.flush()

    async def stored() -> bool:
        return (await js.stream_info(EVENTS_STREAM)).state.last_seq >= before + len(sent)

    await eventually_async(stored, 20.0, message=f"{len(sent)} events stored")


async def wait_all_acked(js: JetStreamContext, timeout_s: float = 30.0) -> None:
    async def drained() -> bool:
        info = await js.consumer_info(EVENTS_STREAM, RECORDER_CONSUMER)
        return info.num_pending == 0 and info.num_ack_pending == 0

    await eventually_async(drained, timeout_s, message="every event acked or terminated")


async def fetchval(url: str, sql: str) -> Any:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetchval(sql)
    finally:
        await conn.close()


async def wait_rows(url: str, table: str, expected: int, timeout_s: float = 30.0) -> None:
    async def reached() -> bool:
        return await fetchval(url, f"SELECT count(*) FROM {table}") >= expected

    await eventually_async(reached, timeout_s, message=f"{expected} rows in {table}")


async def snapshot(url: str, tables: tuple[str, ...] = PROJECTIONS) -> dict[str, list[tuple]]:
    """Every row of `tables`, in a stable order, for comparing whole tables."""
    conn = await asyncpg.connect(url)
    try:
        return {t: [tuple(r) for r in await conn.fetch(f"SELECT * FROM {t} ORDER BY 1, 2")] for t in tables}
    finally:
        await conn.close()


class LogWatch(logging.Handler):
    """Collects `helexa.*` log records and lets a test wait for one, instead of sleeping."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.changed = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self.changed.set()

    def matching(self, message: str, **fields: Any) -> list[logging.LogRecord]:
        return [
            r for r in self.records
            if r.getMessage() == message and all(getattr(r, k, None) == v for k, v in fields.items())
        ]  # fmt: skip

    async def wait_for(
        self, message: str, *, task: asyncio.Task | None = None, timeout_s: float = 30.0, **fields: Any
    ) -> logging.LogRecord:
        async with asyncio.timeout(timeout_s):
            while True:
                if found := self.matching(message, **fields):
                    return found[0]
                if task is not None and task.done():
                    task.result()
                    raise AssertionError(f"recorder exited before logging {message!r}")
                self.changed.clear()
                await self.changed.wait()


@pytest.fixture
def log_watch() -> Iterator[LogWatch]:
    watch = LogWatch()
    logger = logging.getLogger("helexa")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(watch)
    try:
        yield watch
    finally:
        logger.removeHandler(watch)
        logger.setLevel(level)


@asynccontextmanager
async def recording(settings: RecorderSettings, watch: LogWatch, rebuild: bool = False) -> AsyncIterator[asyncio.Task]:
    """`run_recorder` as a task for the block's duration; stopped through its stop event, as SIGTERM would."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(settings, stop, rebuild=rebuild))
    task.add_done_callback(lambda _: watch.changed.set())
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)

"""Recorder test fixtures: a fresh database per test, events to publish, a running recorder, its logs."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import asyncpg
import pytest

from apps.bus.wire import RunFinished, RunStarted
from apps.embedded.postgres import PostgresServer
from apps.recorder.app import run_recorder
from apps.settings import RecorderSettings


@pytest.fixture
async def database_url(postgres: PostgresServer) -> AsyncIterator[str]:
    """An empty database of its own on the session's PostgreSQL."""
    name = f"recorder_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres.url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        yield postgres.url.rsplit("/", 1)[0] + "/" + name
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def started(request_id: str, **fields: Any) -> RunStarted:
    defaults: dict[str, Any] = dict(
        model="tiny", node="node-a", api="chat.completions", principal="alice",
        prompt_tokens=12, attempt=1, queue_ms=3.0,
    )  # fmt: skip
    return RunStarted(request_id=request_id, **{**defaults, **fields})


def finished(request_id: str, **fields: Any) -> RunFinished:
    defaults: dict[str, Any] = dict(
        model="tiny", node="node-a", api="chat.completions", principal="alice",
        status="ok", finish_reason="stop", prompt_tokens=12, completion_tokens=7, cached_tokens=4,
        attempt=1, queue_ms=3.0, ttft_ms=20.0, prefill_ms=15.0, decode_ms=40.0, e2e_ms=63.0,
    )  # fmt: skip
    return RunFinished(request_id=request_id, **{**defaults, **fields})


async def eventually(check: Callable[[], Awaitable[bool]], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll `check` until it holds, failing after a bounded deadline."""
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.05)


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
async def recording(settings: RecorderSettings, watch: LogWatch) -> AsyncIterator[asyncio.Task]:
    """`run_recorder` as a task for the block's duration; stopped through its stop event, as SIGTERM would."""
    stop = asyncio.Event()
    task = asyncio.create_task(run_recorder(settings, stop))
    task.add_done_callback(lambda _: watch.changed.set())
    try:
        yield task
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)

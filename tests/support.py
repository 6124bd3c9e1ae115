"""Test helpers: run helexa apps as real subprocesses and wait for their `ready` log line,
`eventually`, the one way a test polls for a condition, and byte-level token ids for text."""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import asyncpg

from apps.bus import connection
from apps.bus.topology import BusLimits
from apps.embedded.nats_server import NatsCluster, NatsServer
from apps.embedded.postgres import PostgresServer

if TYPE_CHECKING:
    from apps.bus.events import AnyEvent
    from engine.frontend.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent

# A `helexa bench` config whose one target is a port nothing listens on (format it with `port`).
BENCH_AGAINST_NOTHING = """
models = ["m"]
scenarios = ["chat:8"]
[[targets]]
name = "t"
base_url = "http://127.0.0.1:{port}/v1"
"""


def declared(server: NatsServer | NatsCluster, limits: BusLimits | None = None) -> None:
    """Declare the topology on `server` as its administrator, as `helexa up` does (apps may not)."""
    asyncio.run(connection.setup(server.url, limits or BusLimits()))

async def migrated_database(postgres: PostgresServer, prefix: str) -> str:
    """A new database on `postgres`, migrated as its owner; its URL. Left for the server to drop."""
    import asyncpg

    from apps.recorder.migrate import migrate

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres.url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    url = postgres.url.rsplit("/", 1)[0] + "/" + name
    await migrate(url)
    return url


T = TypeVar("T")


async def fetch_rows(database_url: str, sql: str, *args: object) -> list[asyncpg.Record]:
    """The rows of one query, on a connection of its own."""
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(sql, *args)
    finally:
        await conn.close()


def eventually(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.05,
               message: str | Callable[[], str] = "") -> T:
    """Poll `predicate` until it returns something truthy, and return that; fail after `timeout_s`
    with `message` (or the last falsy value), so a wait never hangs and never passes silently."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = message() if callable(message) else message
            raise AssertionError(f"not true within {timeout_s} s: {detail or value!r}")
        time.sleep(interval_s)


async def eventually_async(predicate: Callable[[], Awaitable[T] | T], timeout_s: float, interval_s: float = 0.05,
                           message: str | Callable[[], str] = "") -> T:
    """`eventually` from async tests: sleeps without blocking the loop, so the work it waits for runs
    meanwhile (`interval_s=0` gives the loop one turn between checks); `predicate` may be a coroutine."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            detail = message() if callable(message) else message
            raise AssertionError(f"not true within {timeout_s} s: {detail or value!r}")
        await asyncio.sleep(interval_s)


def _byte_level_char(byte: int) -> str:
    # GPT-2 byte-level alphabet: printable Latin-1 bytes stand for themselves, the other bytes
    # are shifted to 256 + their rank among the non-printable ones.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    if byte in printable:
        return chr(byte)
    return chr(256 + [b for b in range(256) if b not in printable].index(byte))


def byte_token_ids(tok: Tokenizer, text: str) -> list[int]:
    """`text` as one byte-level BPE token per UTF-8 byte (what a model may emit, a character split)."""
    ids = [tok.hf.token_to_id(_byte_level_char(b)) for b in text.encode("utf-8")]
    assert None not in ids
    return ids


class AppProcess:
    """A `helexa <app>` child whose JSON log lines are collected as they arrive."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.args = args
        self.lines: list[dict] = []
        self._raw: list[str] = []
        self._queue: queue.Queue[dict | None] = queue.Queue()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", *args],
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            self._raw.append(raw)
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            if isinstance(entry, dict):
                self.lines.append(entry)
                self._queue.put(entry)
        self._queue.put(None)

    def wait_for(self, predicate: Callable[[dict], bool], timeout_s: float = 180.0) -> dict:
        """Block until a log line matches; fail with the app's output if it exits or times out."""
        for entry in self.lines:
            if predicate(entry):
                return entry
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{self.args} gave no matching line:\n{self.output()}")
            try:
                entry = self._queue.get(timeout=remaining)
            except queue.Empty:
                continue
            if entry is None:
                raise RuntimeError(f"{self.args} exited ({self.process.poll()}):\n{self.output()}")
            if predicate(entry):
                return entry

    def wait_ready(self, timeout_s: float = 180.0) -> dict:
        return self.wait_for(lambda e: e.get("event") == "ready", timeout_s)

    def output(self, last: int = 200) -> str:
        """The app's `last` lines of output (stdout and stderr), as it wrote them."""
        return "".join(self._raw[-last:])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._reader.join(5)
        return self.process.returncode

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


class Emitted:
    """Stands in for the gateway's event publisher where a store is tested alone: keeps what the
    store emits, and EVENTS always has room."""

    def __init__(self) -> None:
        self.events: list[AnyEvent] = []

    def emit(self, event: AnyEvent) -> None:
        self.events.append(event)

    def check_room(self, model: str | None = None) -> None:
        pass


class LoopTurns:
    """Counts the event loop's turns while it is entered: a test reads `count` at points of work
    that must let the loop go (it does not move while the work holds the loop)."""

    def __init__(self) -> None:
        self.count = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> LoopTurns:
        self._task = asyncio.create_task(self._turn())
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()

    async def _turn(self) -> None:
        while True:
            self.count += 1
            await asyncio.sleep(0)

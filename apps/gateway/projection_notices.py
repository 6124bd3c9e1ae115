"""Waiting for the recorder to project a stored response, by its word rather than by polling.

The recorder announces every response.stored and response.deleted it commits on the PostgreSQL
channel `helexa_responses` (NOTIFY, payload: the response id, delivered at commit). A gateway asked
for a response it has never seen (made moments ago through another gateway) listens on one
connection of its own and wakes the readers waiting for that id, which then read the ledger once.

While the listening connection is down, readers fall back to reading the ledger every
`FALLBACK_RECHECK_S`; a reconnect wakes every waiter so none misses a notice sent meanwhile.
Uploaded files are announced the same way on `helexa_files` (a `ProjectionNotices` of that channel). At
most `max_waiters` reads wait at once, and at most an eighth of them for one principal (reads of ids
made "now" cost a client nothing to invent: one key's flood must not leave everyone's real reads of
another gateway's fresh objects without a wait); past that a read does not wait.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import asyncpg

from apps.recorder.projections import RESPONSES_CHANNEL

log = logging.getLogger("helexa.gateway")

FALLBACK_RECHECK_S = 1.0

T = TypeVar("T")


class ProjectionNotices:
    def __init__(self, database_url: str, max_waiters: int = 1024, channel: str = RESPONSES_CHANNEL) -> None:
        self._database_url = database_url
        self._channel = channel
        self.max_waiters = max_waiters
        self.max_waiters_per_principal = max(max_waiters // 8, 1)
        self._conn: asyncpg.Connection | None = None
        self._lock = asyncio.Lock()
        self._waiting: dict[str, set[asyncio.Event]] = {}
        self._count = 0
        self._by_principal: dict[str, int] = {}

    @property
    def listening(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    @property
    def waiters(self) -> int:
        return self._count

    @asynccontextmanager
    async def expecting(self, response_id: str, principal: str | None = None) -> AsyncIterator[asyncio.Event | None]:
        """An event set when the recorder announces `response_id` (or the listener reconnects);
        None when too many reads wait already, in all or of `principal`'s (anonymous reads count
        only in all)."""
        if self._count >= self.max_waiters or (
                principal is not None and self._by_principal.get(principal, 0) >= self.max_waiters_per_principal):
            yield None
            return
        arrived = asyncio.Event()
        self._waiting.setdefault(response_id, set()).add(arrived)
        self._count += 1
        if principal is not None:
            self._by_principal[principal] = self._by_principal.get(principal, 0) + 1
        try:
            await self.listen()
            yield arrived
        finally:
            self._count -= 1
            if principal is not None:
                left = self._by_principal.pop(principal) - 1
                if left:
                    self._by_principal[principal] = left
            waiting = self._waiting.get(response_id)
            if waiting is not None:
                waiting.discard(arrived)
                if not waiting:
                    del self._waiting[response_id]

    async def read_when_projected(self, item_id: str, made_at_s: float | None, wait_s: float,
                                  read: Callable[[], Awaitable[T]], principal: str | None = None) -> T:
        """`read()` now; for an id made moments ago (within `wait_s` of `made_at_s`: probably through
        another gateway, not projected yet) that it does not find, again on each of the recorder's
        notices for it (every `FALLBACK_RECHECK_S` while not listening) until found or the wait is over."""
        found = await read()
        if found or made_at_s is None or not made_at_s - 1.0 <= time.time() < made_at_s + wait_s:
            return found
        async with self.expecting(item_id, principal) as arrived:
            while arrived is not None:
                arrived.clear()  # before the read: a notice during it is not missed
                found = await read()
                remaining = made_at_s + wait_s - time.time()
                if found or remaining <= 0:
                    break
                if not self.listening:
                    await self.listen()
                wait = remaining if self.listening else min(remaining, FALLBACK_RECHECK_S)
                try:
                    await asyncio.wait_for(arrived.wait(), wait)
                except TimeoutError:
                    pass
        return found

    async def listen(self) -> None:
        """Listen on the channel, unless already listening; on failure, readers fall back to rechecks."""
        async with self._lock:
            if self.listening:
                return
            try:
                conn = await asyncpg.connect(self._database_url, timeout=5)
                await conn.add_listener(self._channel, self._on_notice)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
                log.warning("not listening for projected responses; reading the ledger every second instead",
                            extra={"error": repr(exc)})
                return
            conn.add_termination_listener(self._on_lost)
            self._conn = conn
            # A notice sent before this connection listened is not heard: everyone reads again.
            self._wake_all()

    def _on_notice(self, _conn: object, _pid: int, _channel: str, payload: str) -> None:
        for arrived in self._waiting.get(payload, ()):
            arrived.set()

    def _on_lost(self, _conn: object) -> None:
        self._conn = None
        self._wake_all()

    def _wake_all(self) -> None:
        for waiting in self._waiting.values():
            for arrived in waiting:
                arrived.set()

    async def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None and not conn.is_closed():
            await conn.close()

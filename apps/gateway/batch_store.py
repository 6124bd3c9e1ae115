"""Batches (/v1/batches): what a batch is and where it stands, as the ledger has it.

A batch's state is events, as every stored thing here: `batch.created` when it is made,
`batch.status` at each step, `batch.line` per finished line (`apps.gateway.batch_runner`), which the
recorder projects into `batches` and `batch_lines` (migration 0010); the gateway's PostgreSQL role
only reads them. Making a batch also puts a claim on the BATCHES work queue, which one gateway's
runner takes. A batch made moments ago through another gateway is waited for until the recorder
announces it (`helexa_batches` NOTIFY); this gateway's own new batches are served from memory
until then. A missing batch and another principal's are the same 404.

The live-batch cap per principal holds across gateways by construction: a create takes the
principal's PostgreSQL advisory lock (transaction-scoped, on a connection of the gateway's read
role), counts the principal's live batches in the ledger, emits `batch.created` and keeps the lock
until the recorder has projected it, so the next create through any gateway counts it. A batch the
recorder does not project within the wait is marked `failed` at once (it never runs) and the
create is a 503, so it never counts against the cap unseen.

The Batch object is built from the row and the counts of its lines: `completed` are the lines
answered 200, `failed` the others (errors and invalid lines), `total` the input file's lines.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import msgspec

from apps.bus import topology, wire
from apps.bus.codes import ErrorCode, ServingError, Unavailable, unavailable
from apps.bus.events import BatchCreated, BatchStatus
from apps.bus.publish import publish
from apps.gateway.bus_failures import BUS_ERRORS, bus_unavailable
from apps.gateway.capability_ids import CapabilityIds
from apps.gateway.events import EventPublisher
from apps.gateway.ledger_pool import LedgerPool
from apps.gateway.projection_notices import ProjectionNotices
from apps.recorder.projections import BATCHES_CHANNEL

BATCH_IDS = CapabilityIds("batch_")
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOWS = {"24h": 24 * 3600}
TERMINAL = ("completed", "failed", "expired", "cancelled")
_STATUS_TIMES = ("in_progress", "cancelling", "finalizing", "completed", "failed", "expired", "cancelled")
# This gateway's own batches kept until the ledger has them.
_RECENT_MAX = 10_000

_ONE = """
SELECT b.*, (SELECT count(*) FILTER (WHERE status_code = 200) FROM batch_lines l WHERE l.batch_id = b.batch_id)
              AS done,
            (SELECT count(*) FILTER (WHERE status_code IS DISTINCT FROM 200) FROM batch_lines l
              WHERE l.batch_id = b.batch_id) AS failed
FROM batches b WHERE b.batch_id = $1 AND b.event_id IS NOT NULL
"""
# A principal's batches past a cursor, newest first.
_PAGE = """
SELECT batch_id FROM batches
WHERE principal IS NOT DISTINCT FROM $1 AND event_id IS NOT NULL AND ($2::text IS NULL OR batch_id < $2)
ORDER BY batch_id DESC LIMIT $3
"""
# A principal's live batches (none of TERMINAL), counted under the principal's creation lock.
_LIVE_COUNT = """
SELECT count(*) FROM batches
WHERE principal IS NOT DISTINCT FROM $1 AND event_id IS NOT NULL AND status <> ALL($2::text[])
"""
# The principal's creation lock, held to the end of the create's transaction.
_LOCK = "SELECT pg_advisory_xact_lock(hashtextextended('helexa.batch.create:' || $1, 0))"
# How long a create waits for a connection to take the lock on, and how many creates take locks at once.
_LOCK_WAIT_S = 10.0
_LOCK_CONNECTIONS = 2
_LINES_DONE = "SELECT line FROM batch_lines WHERE batch_id = $1"
# A batch's answered lines ($2 true) or the others, after line $3, in line order: the output files
# are written a page at a time, never the whole batch in memory. A page is at most LINES_PAGE lines
# and PAGE_BYTES of their bodies and errors (at least one line), chosen from their sizes first.
_LINES_AFTER = "batch_id = $1 AND (coalesce(status_code, 0) = 200) = $2 AND line > $3"
_LINE_SIZES = (f"SELECT line, coalesce(octet_length(body::text), 0) + coalesce(octet_length(error::text), 0) AS bytes"
               f" FROM batch_lines WHERE {_LINES_AFTER} ORDER BY line LIMIT $4")
_LINES_UP_TO = f"SELECT * FROM batch_lines WHERE {_LINES_AFTER} AND line <= $4 ORDER BY line"
LINES_PAGE = 256
PAGE_BYTES = 8 << 20


@dataclass(slots=True, frozen=True)
class StoredBatch:
    row: dict[str, Any]

    @property
    def batch_id(self) -> str:
        return str(self.row["batch_id"])

    @property
    def principal(self) -> str | None:
        return self.row["principal"]

    @property
    def status(self) -> str:
        return str(self.row["status"])

    def as_object(self) -> dict[str, Any]:
        """The OpenAI Batch object."""
        row = self.row
        errors = row.get("errors")
        return {
            "id": row["batch_id"], "object": "batch", "endpoint": row["endpoint"],
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row.get("output_file_id"),
            "error_file_id": row.get("error_file_id"), "created_at": row["created_at"],
            "expires_at": row["expires_at"], "metadata": row.get("metadata"),
            "errors": {"object": "list", "data": errors} if errors else None,
            "request_counts": {"total": row.get("total") or 0, "completed": row.get("done") or 0,
                               "failed": row.get("failed") or 0},
            **{f"{status}_at": row.get(f"{status}_at") for status in _STATUS_TIMES},
        }


def _decoded(row: asyncpg.Record) -> dict[str, Any]:
    out = dict(row)
    for key in ("metadata", "errors"):
        if isinstance(out.get(key), str):
            out[key] = msgspec.json.decode(out[key])
    return out


def over_cap(cap: int) -> ServingError:
    return ServingError(429, ErrorCode.RATE_LIMIT_EXCEEDED,
                        f"You have {cap} live batches, the most a principal may have "
                        "(max_live_batches_per_principal): wait for one to end, or cancel one.",
                        param="max_live_batches_per_principal")


def not_found(batch_id: str) -> ServingError:
    shown = batch_id if BATCH_IDS.valid(batch_id) else wire.bounded_text(batch_id, 64)
    return ServingError(404, ErrorCode.BATCH_NOT_FOUND, f"No batch found with id '{shown}'.", param="batch_id",
                        context={"detail": "unknown or another principal's batch"})


class BatchStore:
    def __init__(self, database_url: str, events: EventPublisher, js: Any, projection_wait_s: float = 30.0) -> None:
        self._events = events
        self._js = js
        self.projection_wait_s = projection_wait_s
        self._notices = ProjectionNotices(database_url, channel=BATCHES_CHANNEL)
        self._ledger = LedgerPool(database_url)
        # Connections that hold a principal's creation lock, apart from the reads a create waits on.
        self._locks = LedgerPool(database_url, max_size=_LOCK_CONNECTIONS)
        self._recent: OrderedDict[str, StoredBatch] = OrderedDict()

    async def close(self) -> None:
        await self._notices.close()
        await self._ledger.close()
        await self._locks.close()

    # -- writing --------------------------------------------------------------------------------

    async def create(self, principal: str | None, input_file_id: str, endpoint: str, window: str,
                     metadata: dict[str, str] | None, live_cap: int) -> StoredBatch:
        """Record a new batch and put its claim on the BATCHES work queue, unless `principal` has
        `live_cap` live batches already (429 naming `max_live_batches_per_principal`)."""
        self._events.check_room()
        try:
            pool = await self._locks.get()
            async with pool.acquire(timeout=_LOCK_WAIT_S) as conn, conn.transaction():
                await conn.execute(_LOCK, principal or "")
                live = await conn.fetchval(_LIVE_COUNT, principal, list(TERMINAL))
                if live >= live_cap:
                    raise over_cap(live_cap)
                stored = await self._record(principal, input_file_id, endpoint, window, metadata)
                if await self._projected(stored.batch_id) is None:
                    self.set_status(stored.batch_id, "failed", errors=[{
                        "code": "not_recorded", "message": "The ledger did not record the batch in time."}])
                    raise unavailable(Unavailable.LEDGER_UNAVAILABLE,
                                      {"detail": f"batch {stored.batch_id} not projected in time; marked failed"})
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise unavailable(Unavailable.LEDGER_UNAVAILABLE, {"detail": f"postgres: {exc!r}"}) from None
        return stored

    async def _projected(self, batch_id: str) -> StoredBatch | None:
        async def from_ledger() -> StoredBatch | None:
            rows = await self.fetch(_ONE, batch_id)
            return StoredBatch(_decoded(rows[0])) if rows else None
        return await self._notices.read_when_projected(batch_id, BATCH_IDS.made_at_s(batch_id),
                                                       self.projection_wait_s, from_ledger)

    async def _record(self, principal: str | None, input_file_id: str, endpoint: str, window: str,
                      metadata: dict[str, str] | None) -> StoredBatch:
        batch_id = BATCH_IDS.new()
        now = int(time.time())
        created = BatchCreated(model="-", node="gateway", batch_id=batch_id, principal=principal,
                                    input_file_id=input_file_id, endpoint=endpoint, completion_window=window,
                                    metadata=metadata, created_at=now, expires_at=now + COMPLETION_WINDOWS[window])
        self._events.emit(created)
        try:
            await publish(self._js(), topology.BATCH_SUBJECT, batch_id.encode(), batch_id)
        except BUS_ERRORS as exc:
            # Recorded, but no runner will ever claim it: it ends here rather than stay live for good.
            self.set_status(batch_id, "failed", errors=[{
                "code": "not_queued", "message": "The batch could not be queued (the message bus is unavailable)."}])
            raise bus_unavailable(exc, f"queueing batch {batch_id} (marked failed)",
                                  full=Unavailable.QUEUE_FULL) from None
        stored = StoredBatch({"batch_id": batch_id, "principal": principal, "input_file_id": input_file_id,
                              "endpoint": endpoint, "completion_window": window, "metadata": metadata,
                              "created_at": now, "expires_at": created.expires_at, "status": "validating"})
        self._recent[batch_id] = stored
        while len(self._recent) > _RECENT_MAX:
            self._recent.popitem(last=False)
        return stored

    def set_status(self, batch_id: str, status: str, **fields: Any) -> None:
        self._events.emit(BatchStatus(model="-", node="gateway", batch_id=batch_id, status=status,
                                           at=int(time.time()), **fields))

    async def cancel(self, batch_id: str, principal: str | None) -> StoredBatch:
        stored = await self.get(batch_id, principal)
        if stored.status not in TERMINAL and stored.status != "finalizing":
            self._events.check_room()
            self.set_status(batch_id, "cancelling")
            return StoredBatch({**stored.row, "status": "cancelling", "cancelling_at": int(time.time())})
        return stored

    # -- reading --------------------------------------------------------------------------------

    async def get(self, batch_id: str, principal: str | None) -> StoredBatch:
        if not BATCH_IDS.valid(batch_id):
            raise not_found(batch_id)
        stored = await self.read(batch_id, principal=principal)
        if stored is None or stored.principal != principal:
            raise not_found(batch_id)
        return stored

    async def read(self, batch_id: str, wait_s: float | None = None,
                   principal: str | None = None) -> StoredBatch | None:
        """The batch from the ledger, else this gateway's new one, else (made moments ago, through
        another gateway) from the ledger once the recorder announces it."""
        wait = self.projection_wait_s if wait_s is None else wait_s
        return await self._notices.read_when_projected(batch_id, BATCH_IDS.made_at_s(batch_id), wait,
                                                       lambda: self._one_or_recent(batch_id), principal)

    async def _one_or_recent(self, batch_id: str) -> StoredBatch | None:
        rows = await self.fetch(_ONE, batch_id)
        if rows:
            self._recent.pop(batch_id, None)
            return StoredBatch(_decoded(rows[0]))
        return self._recent.get(batch_id)

    async def page(self, principal: str | None, limit: int, after: str | None) -> tuple[list[StoredBatch], bool]:
        ids = [row["batch_id"] for row in await self.fetch(_PAGE, principal, after, limit + 1)]
        mine = [b for b in self._recent.values() if b.principal == principal and b.batch_id not in ids
                and (after is None or b.batch_id < after)]
        batches = [b for b in [*(await self._many(ids)), *mine] if b is not None]
        batches.sort(key=lambda b: b.batch_id, reverse=True)
        return batches[:limit], len(batches) > limit

    async def _many(self, ids: list[str]) -> list[StoredBatch | None]:
        return [await self._one_or_recent(batch_id) for batch_id in ids]

    async def lines_done(self, batch_id: str) -> set[int]:
        return {row["line"] for row in await self.fetch(_LINES_DONE, batch_id)}

    async def line_pages(self, batch_id: str, answered: bool, page: int = LINES_PAGE,
                         page_bytes: int = PAGE_BYTES) -> AsyncIterator[list[asyncpg.Record]]:
        """The batch's answered lines (status 200), or the others, a page at a time in line order."""
        after = 0
        while sizes := await self.fetch(_LINE_SIZES, batch_id, answered, after, page):
            last, total = sizes[0]["line"], 0
            for row in sizes:
                total += row["bytes"]
                if total > page_bytes:
                    break
                last = row["line"]
            yield await self.fetch(_LINES_UP_TO, batch_id, answered, after, last)
            after = last

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        return await self._ledger.fetch(query, *args)

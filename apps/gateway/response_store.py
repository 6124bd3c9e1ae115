"""Stored responses (`store`, `previous_response_id`, GET/DELETE /v1/responses/{id}), kept in the
PostgreSQL ledger.

Writing goes through the event stream like everything else the ledger knows: the gateway
publishes `response.stored` (this request's input items, the response object, the model and the
principal) and `response.deleted` onto EVENTS, and the recorder projects them into the
`responses` table (migration 0005). Reading is a query on that table; a conversation is rebuilt
by following `previous_response_id` back to its first response (one recursive query). A
response that does not exist, was deleted, or belongs to another principal is a 404 — the same
404, so ids of others cannot be probed.

The race between publishing and projecting (a client that asks for turn 2 right after turn 1):
- this gateway keeps its own recent responses in a small cache (and its deletions as
  tombstones), consulted when the ledger does not have a response yet; the ledger stays the
  authority, so a response deleted through another gateway is gone here too once projected;
- another gateway may be asked for a response it never saw: ids are `resp_<UUIDv7>`, which say
  when they were made, so a response made less than `projection_wait_s` ago is waited for (the
  ledger polled) until that age, while an older unknown id is a 404 at once.
A restarted gateway has an empty cache and reads everything from the ledger.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.uuid7 import uuid7_hex
from apps.gateway.errors import retry_after_s
from apps.gateway.events import EventPublisher

log = logging.getLogger("helexa.gateway")

ID_PREFIX = "resp_"
# Responses one conversation may chain through (a guard against a cycle in a corrupted ledger).
MAX_CHAIN = 10_000
POLL_S = 0.05

_ONE = """
SELECT response_id, principal, previous_response_id, input_items, response, deleted_at, event_id
FROM responses WHERE response_id = $1
"""
# From a response back through its predecessors, as far as the ledger has them, newest first.
_CHAIN = f"""
WITH RECURSIVE chain AS (
    SELECT response_id, principal, previous_response_id, input_items, response, deleted_at, event_id, 0 AS depth
    FROM responses WHERE response_id = $1
  UNION ALL
    SELECT r.response_id, r.principal, r.previous_response_id, r.input_items, r.response, r.deleted_at,
           r.event_id, c.depth + 1
    FROM responses r JOIN chain c ON r.response_id = c.previous_response_id
    WHERE c.depth < {MAX_CHAIN}
)
SELECT * FROM chain ORDER BY depth
"""


def new_response_id() -> str:
    return ID_PREFIX + uuid7_hex()


def created_at_s(response_id: str) -> float | None:
    """When a `resp_<UUIDv7>` id was made (its first 48 bits are Unix milliseconds); None otherwise."""
    digits = response_id.removeprefix(ID_PREFIX)
    if len(digits) != 32 or not response_id.startswith(ID_PREFIX):
        return None
    try:
        return int(digits[:12], 16) / 1000.0
    except ValueError:
        return None


@dataclass(slots=True, frozen=True)
class StoredResponse:
    response_id: str
    principal: str | None
    previous_response_id: str | None
    input_items: list[dict[str, Any]]
    response: dict[str, Any]
    deleted: bool = False

    @property
    def items(self) -> list[dict[str, Any]]:
        """What this turn adds to a conversation: its input, then its output."""
        return [*self.input_items, *self.response.get("output", [])]


def _from_row(row: asyncpg.Record) -> StoredResponse:
    # A row known only by its deletion has no stored columns.
    if row["event_id"] is None:
        return StoredResponse(row["response_id"], row["principal"], None, [], {}, deleted=True)
    return StoredResponse(row["response_id"], row["principal"], row["previous_response_id"],
                          json.loads(row["input_items"]), json.loads(row["response"]),
                          deleted=row["deleted_at"] is not None)


def not_found(response_id: str, param: str | None = None) -> ServingError:
    return ServingError(404, ErrorCode.RESPONSE_NOT_FOUND, f"No response found with id '{response_id}'.",
                        param=param, context={"detail": "unknown, deleted or another principal's response"})


@dataclass(slots=True)
class _Recent:
    """This gateway's own responses until the ledger has them, and its own deletions (bounded,
    oldest dropped first; entries older than `ttl_s` are ignored)."""

    max_entries: int
    ttl_s: float
    kept: OrderedDict[str, tuple[float, StoredResponse]] = field(default_factory=OrderedDict)
    deleted: OrderedDict[str, float] = field(default_factory=OrderedDict)

    @staticmethod
    def _bounded(entries: OrderedDict[str, Any], key: str, value: Any, limit: int) -> None:
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > limit:
            entries.popitem(last=False)

    def put(self, stored: StoredResponse) -> None:
        self._bounded(self.kept, stored.response_id, (time.monotonic(), stored), self.max_entries)

    def delete(self, response_id: str) -> None:
        self._bounded(self.deleted, response_id, time.monotonic(), self.max_entries)

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self.kept.get(response_id)
        if entry is None or time.monotonic() - entry[0] > self.ttl_s:
            return None
        return entry[1]

    def was_deleted(self, response_id: str) -> bool:
        at = self.deleted.get(response_id)
        return at is not None and time.monotonic() - at <= self.ttl_s


class ResponseStore:
    def __init__(self, database_url: str, events: EventPublisher, projection_wait_s: float = 5.0,
                 cache_entries: int = 2048, cache_ttl_s: float = 600.0) -> None:
        self._database_url = database_url
        self._events = events
        self.projection_wait_s = projection_wait_s
        self._recent = _Recent(cache_entries, cache_ttl_s)
        self._pool: asyncpg.Pool | None = None
        self._pool_lock = asyncio.Lock()

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()

    def keep(self, stored: StoredResponse, model: str) -> None:
        """Store a response: on the ledger (through EVENTS) and in the recent cache."""
        self._recent.put(stored)
        self._events.emit(wire.ResponseStored(
            model=model, node="gateway", response_id=stored.response_id, principal=stored.principal,
            previous_response_id=stored.previous_response_id, input_items=stored.input_items,
            response=stored.response))

    async def delete(self, response_id: str, principal: str | None) -> StoredResponse:
        """Delete one of `principal`'s responses (404 if it has none of that id)."""
        stored = await self.get(response_id, principal)
        self._recent.delete(response_id)
        self._events.emit(wire.ResponseDeleted(model=stored.response.get("model") or "-", node="gateway",
                                               response_id=response_id, principal=principal))
        return stored

    async def get(self, response_id: str, principal: str | None, param: str | None = None) -> StoredResponse:
        chain = await self._chain(response_id, principal, param, length=1)
        return chain[0]

    async def conversation(self, response_id: str, principal: str | None) -> list[dict[str, Any]]:
        """Every item of the conversation `response_id` ends, oldest first (inputs and outputs)."""
        chain = await self._chain(response_id, principal, "previous_response_id", length=MAX_CHAIN)
        return [item for stored in reversed(chain) for item in stored.items]

    async def _chain(self, response_id: str, principal: str | None, param: str | None,
                     length: int) -> list[StoredResponse]:
        """`response_id` and up to `length - 1` of its predecessors, newest first; the first one must
        be `principal`'s and not deleted (its predecessors may be deleted: they still make up the
        conversation)."""
        chain: list[StoredResponse] = []
        wanted: str | None = response_id
        while wanted is not None and len(chain) < length:
            found = await self._read(wanted, length - len(chain))
            if not found:
                if chain:
                    log.warning("a stored response's predecessor is missing",
                                extra={"response_id": chain[-1].response_id, "previous": wanted})
                raise not_found(response_id, param)
            chain += found
            wanted = chain[-1].previous_response_id
        head = chain[0]
        if head.deleted or self._recent.was_deleted(response_id) or any(s.principal != principal for s in chain):
            raise not_found(response_id, param)
        return chain

    async def _read(self, response_id: str, length: int) -> list[StoredResponse]:
        """The response and its predecessors as far as one source has them: the ledger, else this
        gateway's recent ones, else — for an id made moments ago — the ledger once it has it."""
        found = await self._query_or_recent(response_id, length)
        created = created_at_s(response_id)
        if found or created is None or not created - 1.0 <= time.time() < created + self.projection_wait_s:
            return found
        # Made moments ago, probably by another gateway: the recorder has not projected it yet.
        while not found and time.time() < created + self.projection_wait_s:
            await asyncio.sleep(POLL_S)
            found = await self._query_or_recent(response_id, length)
        return found

    async def _query_or_recent(self, response_id: str, length: int) -> list[StoredResponse]:
        recent = self._recent.get(response_id)
        try:
            found = await self._query(response_id, length)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            if recent is not None:
                return [recent]
            raise ServingError(503, ErrorCode.LEDGER_UNAVAILABLE,
                               "Stored responses cannot be read right now; retry shortly.",
                               retry_after_s=retry_after_s(), context={"detail": f"postgres: {exc!r}"}) from None
        return found or ([recent] if recent is not None else [])

    async def _query(self, response_id: str, length: int) -> list[StoredResponse]:
        pool = await self._connected()
        async with pool.acquire() as conn:
            if length == 1:
                row = await conn.fetchrow(_ONE, response_id)
                return [_from_row(row)] if row is not None else []
            return [_from_row(row) for row in await conn.fetch(_CHAIN, response_id)]

    async def _connected(self) -> asyncpg.Pool:
        async with self._pool_lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(self._database_url, min_size=0, max_size=4, timeout=5,
                                                       command_timeout=10)
            return self._pool

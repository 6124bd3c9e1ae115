"""Stored responses (`store`, `previous_response_id`, GET/DELETE /v1/responses/{id}), kept in the
PostgreSQL ledger.

Writing goes through the event stream like everything else the ledger knows: the gateway
publishes `response.stored` (this request's input items, the response object, the model and the
principal) and `response.deleted` onto EVENTS, and the recorder projects them into the
`responses` table (migrations 0005, 0006); a deletion erases the content. Reading is a query on
that table; a conversation is rebuilt by following `previous_response_id` back to its first
response (one recursive query, cut at `StoreLimits.max_chain_responses` responses and
`max_chain_bytes` bytes, so a long chain is refused before any work rather than loaded), then
decoded a response at a time into the typed input items it continues with, the event loop let go
between responses (the response object's fields other than its output, such as its tools and
settings, are skipped unread). A
response that does not exist, was deleted, or belongs to another principal is a 404 — the same
404, so ids of others cannot be probed.

Ids are `resp_` + 12 hex digits of the Unix milliseconds the id was made (not secret) + 32 hex
digits (128 bits) drawn fresh from `secrets`: the id is the capability, as at OpenAI, so keyless
`previous_response_id` works and nobody can guess another's id from their own or from a time.

The race between publishing and projecting (a client that asks for turn 2 right after turn 1):
- this gateway keeps its own recent responses in a cache bounded in bytes with real expiry (and
  its deletions as tombstones), consulted when the ledger does not have a response yet; the
  ledger stays the authority, so a response deleted through another gateway is gone here too;
- another gateway may be asked for a response it never saw: an id made less than
  `projection_wait_s` ago is waited for until the recorder announces it (`projection_notices`,
  NOTIFY at the commit that projects it), however long the recorder takes within that window; an
  older unknown id is a 404 at once.
A restarted gateway has an empty cache and reads everything from the ledger.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Protocol

import asyncpg
import msgspec

from apps.bus import wire
from apps.bus.codes import ErrorCode, ServingError, Unavailable, unavailable
from apps.bus.events import AnyEvent, ResponseDeleted, ResponseStored
from apps.gateway.api import responses_schema as rs
from apps.gateway.capability_ids import CapabilityIds
from apps.gateway.ledger_pool import LedgerPool
from apps.gateway.projection_notices import ProjectionNotices

log = logging.getLogger("helexa.gateway")

# Ids made now (44 hex digits), and the UUIDv7 ids of earlier versions (32) still in ledgers.
RESPONSE_IDS = CapabilityIds("resp_", also_valid="[0-9a-f]{32}")
ID_PREFIX = RESPONSE_IDS.prefix

# A row's content is read only for its owner ($2): another principal's read of an id gets its
# principal (for the one 404) and nothing of what it holds, however large.
_OWNED = "CASE WHEN {t}principal IS NOT DISTINCT FROM ${n} THEN {t}{column} END AS {column}"
_ONE = f"""
SELECT response_id, principal, previous_response_id, {_OWNED.format(t="", n=2, column="input_items")},
       {_OWNED.format(t="", n=2, column="response")}, deleted_at, event_id, stored_bytes
FROM responses WHERE response_id = $1
"""
# From a response back through its predecessors, newest first, while within $2 responses and
# until past $3 bytes (the row that crosses it is read, so the caller sees the chain goes on), and
# only through the reader's ($4) own responses: the first of another's ends it, unread.
_CHAIN = f"""
WITH RECURSIVE chain AS (
    SELECT response_id, principal, previous_response_id, {_OWNED.format(t="", n=4, column="input_items")},
           {_OWNED.format(t="", n=4, column="response")}, deleted_at, event_id, stored_bytes,
           stored_bytes AS total, 0 AS depth
    FROM responses WHERE response_id = $1
  UNION ALL
    SELECT r.response_id, r.principal, r.previous_response_id, {_OWNED.format(t="r.", n=4, column="input_items")},
           {_OWNED.format(t="r.", n=4, column="response")}, r.deleted_at,
           r.event_id, r.stored_bytes, c.total + r.stored_bytes, c.depth + 1
    FROM responses r JOIN chain c ON r.response_id = c.previous_response_id
    WHERE c.depth + 1 < $2 AND c.total <= $3 AND c.principal IS NOT DISTINCT FROM $4
)
SELECT * FROM chain ORDER BY depth
"""


@dataclass(slots=True, frozen=True)
class StoreLimits:
    """What one stored response and one conversation may hold, and this gateway's cache."""

    # A response's stored input items and echoed request fields (413 above, before it runs).
    max_response_bytes: int = 4 << 20
    # A `previous_response_id` conversation: responses and stored bytes (400 above, before it runs).
    max_chain_responses: int = 1024
    max_chain_bytes: int = 16 << 20
    # This gateway's recent responses, until the ledger has them.
    cache_bytes: int = 64 << 20
    cache_ttl_s: float = 600.0

    def __post_init__(self) -> None:
        if min(self.max_response_bytes, self.max_chain_responses, self.max_chain_bytes, self.cache_bytes) < 1:
            raise ValueError("stored-response limits must be positive")
        if self.cache_ttl_s <= 0:
            raise ValueError("the response cache's TTL must be positive")


class Events(Protocol):
    """Where a store's events go (`apps.gateway.events.EventPublisher`); the file store's too."""

    def emit(self, event: AnyEvent) -> None: ...

    def check_room(self, model: str | None = None) -> None: ...


new_response_id = RESPONSE_IDS.new
valid_id = RESPONSE_IDS.valid
created_at_s = RESPONSE_IDS.made_at_s


def stored_size(input_items: list[dict[str, Any]], response: dict[str, Any]) -> int:
    """A stored response's bytes as the ledger counts them (`responses.stored_bytes`), about."""
    return len(wire.encode(input_items)) + len(wire.encode(response))


def without_nul(value: Any) -> Any:
    """`value` with every NUL in its strings replaced by U+FFFD, as the ledger records them."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, list):
        return [without_nul(v) for v in value]
    if isinstance(value, dict):
        return {without_nul(k): without_nul(v) for k, v in value.items()}
    return value


@dataclass(slots=True, frozen=True)
class NewResponse:
    """A response to store, as the handler has it: its input items and the response object."""

    response_id: str
    principal: str | None
    previous_response_id: str | None
    input_items: list[dict[str, Any]]
    response: dict[str, Any]


class _StoredOutput(msgspec.Struct):
    """The part of a stored response object a conversation reads: its output items, as input
    items (every other field is skipped unread)."""

    output: list[rs.InputItem] = []


class _StoredModel(msgspec.Struct):
    model: str | None = None


_items_decoder = msgspec.json.Decoder(list[rs.InputItem])
_output_decoder = msgspec.json.Decoder(_StoredOutput)
_model_decoder = msgspec.json.Decoder(_StoredModel)


@dataclass(slots=True, frozen=True)
class StoredResponse:
    """A stored response as read back: its input items and response object kept as the JSON the
    ledger holds, decoded only into what a reader needs (typed, so the rest is skipped unread)."""

    response_id: str
    principal: str | None
    previous_response_id: str | None
    input_json: bytes = b"[]"
    response_json: bytes = b"{}"
    deleted: bool = False

    @property
    def size(self) -> int:
        return len(self.input_json) + len(self.response_json)

    @property
    def model(self) -> str | None:
        return _model_decoder.decode(self.response_json).model

    def items(self) -> list[rs.InputItem]:
        """What this turn adds to a conversation: its input, then its output (a 400 naming
        `previous_response_id` if the ledger holds something this gateway cannot read)."""
        try:
            return [*_items_decoder.decode(self.input_json), *_output_decoder.decode(self.response_json).output]
        except msgspec.ValidationError as exc:
            raise ServingError(400, ErrorCode.INVALID_REQUEST,
                               f"Response '{self.response_id}' of this conversation cannot be continued: {exc}.",
                               param="previous_response_id") from None


def _from_row(row: asyncpg.Record) -> StoredResponse:
    # A deleted response's content is erased; a row known only by its deletion has no stored columns.
    if row["event_id"] is None or row["deleted_at"] is not None or row["response"] is None:
        return StoredResponse(row["response_id"], row["principal"], row["previous_response_id"], deleted=True)
    return StoredResponse(row["response_id"], row["principal"], row["previous_response_id"],
                          row["input_items"].encode(), row["response"].encode())


def not_found(response_id: str, param: str | None = None) -> ServingError:
    shown = response_id if valid_id(response_id) else wire.bounded_text(response_id, 64)
    return ServingError(404, ErrorCode.RESPONSE_NOT_FOUND, f"No response found with id '{shown}'.",
                        param=param, context={"detail": "unknown, deleted or another principal's response"})


# Responses made here with `store: false` that a gateway remembers (about 100 bytes each).
MAX_UNSTORED_IDS = 65_536


@dataclass(slots=True)
class RecentResponses:
    """This gateway's own responses until the ledger has them, its own deletions, and the ids of
    its responses that will not be stored: at most `max_bytes` of responses and
    `MAX_UNSTORED_IDS` unstored ids, each forgotten `ttl_s` after it was kept (oldest first either
    way). A forgotten unstored id is only slower to refuse (its read waits for the ledger as a fresh
    id from elsewhere does); deletions are not capped, as each follows a stored response's read."""

    max_bytes: int
    ttl_s: float
    kept: OrderedDict[str, tuple[float, StoredResponse]] = field(default_factory=OrderedDict)
    deleted: OrderedDict[str, float] = field(default_factory=OrderedDict)
    unstored: OrderedDict[str, float] = field(default_factory=OrderedDict)
    bytes: int = 0

    def _expire(self, now: float) -> None:
        while self.kept and now - next(iter(self.kept.values()))[0] > self.ttl_s:
            self.bytes -= self.kept.popitem(last=False)[1][1].size
        for marks in (self.deleted, self.unstored):
            while marks and now - next(iter(marks.values())) > self.ttl_s:
                marks.popitem(last=False)

    def put(self, stored: StoredResponse) -> None:
        now = time.monotonic()
        self._expire(now)
        self.forget(stored.response_id)
        if stored.size > self.max_bytes:
            return
        self.kept[stored.response_id] = (now, stored)
        self.bytes += stored.size
        while self.bytes > self.max_bytes:
            self.bytes -= self.kept.popitem(last=False)[1][1].size

    def forget(self, response_id: str) -> None:
        entry = self.kept.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry[1].size

    def delete(self, response_id: str) -> None:
        self.forget(response_id)
        self._expire(time.monotonic())
        self.deleted[response_id] = time.monotonic()
        self.deleted.move_to_end(response_id)

    def mark_unstored(self, response_id: str) -> None:
        self._expire(time.monotonic())
        self.unstored[response_id] = time.monotonic()
        while len(self.unstored) > MAX_UNSTORED_IDS:
            self.unstored.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        self._expire(time.monotonic())
        entry = self.kept.get(response_id)
        return entry[1] if entry is not None else None

    def was_deleted(self, response_id: str) -> bool:
        self._expire(time.monotonic())
        return response_id in self.deleted

    def has_none(self, response_id: str) -> bool:
        """Whether this gateway knows `response_id` has no stored response (deleted, or unstored)."""
        return self.was_deleted(response_id) or response_id in self.unstored


class ResponseStore:
    def __init__(self, database_url: str, events: Events, projection_wait_s: float = 30.0,
                 limits: StoreLimits | None = None) -> None:
        self._events = events
        self.projection_wait_s = projection_wait_s
        self.limits = limits or StoreLimits()
        self._recent = RecentResponses(self.limits.cache_bytes, self.limits.cache_ttl_s)
        self._notices = ProjectionNotices(database_url)
        self._ledger = LedgerPool(database_url)

    @property
    def cached_bytes(self) -> int:
        return self._recent.bytes

    async def close(self) -> None:
        await self._notices.close()
        await self._ledger.close()

    def check_storable(self, input_items: list[dict[str, Any]], response: dict[str, Any]) -> None:
        """Before a `store` request runs: its stored part within `max_response_bytes` (413)."""
        size = stored_size(input_items, response)
        if size > self.limits.max_response_bytes:
            raise ServingError(
                413, ErrorCode.REQUEST_TOO_LARGE,
                f"This response would store {size} bytes of input and settings; at most "
                f"{self.limits.max_response_bytes} bytes are stored per response (send less, or 'store': false).",
                param="input")

    def keep(self, new: NewResponse, model: str) -> None:
        """Store a response: on the ledger (through EVENTS) and in the recent cache. A NUL in its
        output is kept as U+FFFD, as the ledger records it."""
        response, encoded = new.response, wire.encode(new.response)
        if b"\\u0000" in encoded:  # JSON's only spelling of a NUL: the walk only when there is one
            response = without_nul(response)
            encoded = wire.encode(response)
        self._recent.put(StoredResponse(new.response_id, new.principal, new.previous_response_id,
                                        wire.encode(new.input_items), encoded))
        self._events.emit(ResponseStored(
            model=model, node="gateway", response_id=new.response_id, principal=new.principal,
            previous_response_id=new.previous_response_id, input_items=new.input_items, response=response))

    def not_stored(self, response_id: str) -> None:
        """A response made here that will not be stored (`store: false`, or its generation failed):
        reading it here is a 404 at once, rather than a wait for a ledger that will never have it
        (the wait a fresh id from elsewhere gets)."""
        self._recent.mark_unstored(response_id)

    async def delete(self, response_id: str, principal: str | None) -> StoredResponse:
        """Delete one of `principal`'s responses (404 if it has none of that id): its content is
        erased from the ledger once the recorder projects the deletion."""
        stored = await self.get(response_id, principal)
        model = stored.model
        self._events.check_room(model)
        self._recent.delete(response_id)
        self._events.emit(ResponseDeleted(model=model or "-", node="gateway",
                                               response_id=response_id, principal=principal))
        return stored

    async def get(self, response_id: str, principal: str | None, param: str | None = None) -> StoredResponse:
        head = await self._head(response_id, principal, param)
        return head[0]

    async def conversation(self, response_id: str, principal: str | None) -> list[rs.InputItem]:
        """Every item of the conversation `response_id` ends, oldest first (inputs and outputs);
        a 400 past the chain limits, a 404 if a response of it was deleted. Each response is
        decoded apart, the event loop let go between them: at most `max_response_bytes` of JSON
        at a time, typed: of a response object only its output is read (its echoed tools and
        settings are skipped unread)."""
        param = "previous_response_id"
        limits = self.limits
        chain = await self._head(response_id, principal, param, limits.max_chain_responses, limits.max_chain_bytes)
        while chain[-1].previous_response_id is not None:
            total = sum(s.size for s in chain)
            if len(chain) >= limits.max_chain_responses or total > limits.max_chain_bytes:
                break
            wanted = chain[-1].previous_response_id
            found = await self._read(wanted, limits.max_chain_responses - len(chain), limits.max_chain_bytes - total,
                                     principal)
            if not found:
                log.warning("a stored response's predecessor is missing",
                            extra={"response_id": chain[-1].response_id, "previous": wanted})
                raise not_found(response_id, param)
            chain += found
        if any(s.principal != principal for s in chain):
            raise not_found(response_id, param)
        total = sum(s.size for s in chain)
        if (len(chain) > limits.max_chain_responses or total > limits.max_chain_bytes
                or (len(chain) == limits.max_chain_responses and chain[-1].previous_response_id is not None)):
            raise ServingError(
                400, ErrorCode.INVALID_REQUEST,
                f"The conversation of '{response_id}' is too long to continue here: at most "
                f"{limits.max_chain_responses} responses and {limits.max_chain_bytes} stored bytes.", param=param)
        gone = next((s for s in chain if s.deleted or self._recent.was_deleted(s.response_id)), None)
        if gone is not None:
            raise ServingError(404, ErrorCode.RESPONSE_NOT_FOUND,
                               f"Response '{gone.response_id}' of this conversation was deleted; its turns are gone.",
                               param=param)
        items: list[rs.InputItem] = []
        for stored in reversed(chain):
            items += stored.items()
            await asyncio.sleep(0)
        return items

    async def _head(self, response_id: str, principal: str | None, param: str | None, length: int = 1,
                    max_bytes: int = 0) -> list[StoredResponse]:
        """`response_id` (and predecessors the same read found), which must be `principal`'s and not deleted.
        Keyless (no principal), the id is all a caller shows: one of an older, guessable form is not found."""
        if not valid_id(response_id) or (principal is None and not RESPONSE_IDS.unguessable(response_id)) \
                or self._recent.has_none(response_id):
            raise not_found(response_id, param)
        chain = await self._read(response_id, length, max_bytes, principal)
        if not chain:
            raise not_found(response_id, param)
        head = chain[0]
        if head.deleted or self._recent.was_deleted(response_id) or head.principal != principal:
            raise not_found(response_id, param)
        return chain

    async def _read(self, response_id: str, length: int, max_bytes: int,
                    principal: str | None) -> list[StoredResponse]:
        """The response and its predecessors as far as one source has them: the ledger, else this
        gateway's recent ones, else — for an id made moments ago — the ledger once the recorder
        announces it."""
        return await self._notices.read_when_projected(
            response_id, created_at_s(response_id), self.projection_wait_s,
            lambda: self._query_or_recent(response_id, length, max_bytes, principal), principal)

    async def _query_or_recent(self, response_id: str, length: int, max_bytes: int,
                               principal: str | None) -> list[StoredResponse]:
        recent = self._recent.get(response_id)
        try:
            found = await self._query(response_id, length, max_bytes, principal)
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            if recent is not None:
                return [recent]
            raise unavailable(Unavailable.LEDGER_UNAVAILABLE, {"detail": f"postgres: {exc!r}"}) from None
        return found or ([recent] if recent is not None else [])

    async def _query(self, response_id: str, length: int, max_bytes: int,
                     principal: str | None) -> list[StoredResponse]:
        """The rows as far as `length` and `max_bytes` allow; of another principal's, only who owns it."""
        pool = await self._ledger.get()
        async with pool.acquire() as conn:
            if length == 1:
                row = await conn.fetchrow(_ONE, response_id, principal)
                return [_from_row(row)] if row is not None else []
            return [_from_row(row) for row in await conn.fetch(_CHAIN, response_id, length, max_bytes, principal)]


"""Uploaded files (/v1/files): content in the NATS Object Store, who owns what in the ledger.

A file's content is object `<file id>` of the `helexa_files` bucket, written and read here in
chunks (`apps.bus.object_streams`), never whole in memory. What the file is (owner, name, purpose,
size) goes through the event stream like every stored thing: the gateway publishes `file.created`
once the content is stored and `file.deleted` once it is gone, and the recorder projects them into
the `files` table (migration 0008), which the gateway's PostgreSQL role may only read. A file that
does not exist, was deleted or is another principal's is the same 404, so ids cannot be probed.

Ids are `file-` + 12 hex digits of the Unix milliseconds the id was made + 32 hex digits (128 bits)
from `secrets`: unguessable, and sorted by creation time, which is how lists are ordered and paged.

The race between publishing and projecting is handled as stored responses handle it
(`response_store`): this gateway keeps its own recent files and deletions until the ledger has them
(bounded in count, with real expiry), and a file made less than `projection_wait_s` ago through
another gateway is waited for until the recorder announces it (`helexa_files` NOTIFY).

Bounds, all checked while the upload streams: the file's bytes, for purpose=batch its lines, each
line's bytes, each line being a JSON object and its `custom_id` at most `MAX_CUSTOM_ID_CHARS`
(`JsonlCheck`), and per principal the number of live files and their bytes together (this
gateway's uploads in flight counted too).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.object_store import ObjectStore

from apps.bus import topology, wire
from apps.bus.codes import ErrorCode, ServingError, Unavailable
from apps.bus.events import FileCreated, FileDeleted
from apps.bus.object_streams import put_stream, read_stream
from apps.bus.publish import is_stream_full
from apps.gateway.bus_failures import BUS_ERRORS, answered_as_unavailable, bus_unavailable
from apps.gateway.capability_ids import CapabilityIds
from apps.gateway.ledger_pool import LedgerPool
from apps.gateway.projection_notices import ProjectionNotices
from apps.gateway.response_store import Events
from apps.recorder.projections import FILES_CHANNEL

log = logging.getLogger("helexa.gateway")

FILE_IDS = CapabilityIds("file-")
ID_PREFIX = FILE_IDS.prefix
PURPOSES = ("batch", "user_data")
# What a file may be listed by: the ones uploaded, and the batches' outputs.
LISTED_PURPOSES = (*PURPOSES, "batch_output")
# This gateway's own files and deletions kept until the ledger has them.
_RECENT_MAX = 10_000
_RECENT_TTL_S = 600.0

_COLUMNS = "file_id, principal, filename, purpose, bytes, created_at, deleted_at, event_id"
_ONE = f"SELECT {_COLUMNS} FROM files WHERE file_id = $1"
# A principal's live files past a cursor, in id (= creation) order; $5: descending.
_PAGE = f"""
SELECT {_COLUMNS} FROM files
WHERE principal IS NOT DISTINCT FROM $1 AND event_id IS NOT NULL AND deleted_at IS NULL
  AND ($2::text IS NULL OR purpose = $2)
  AND ($3::text IS NULL OR (CASE WHEN $5 THEN file_id < $3 ELSE file_id > $3 END))
ORDER BY CASE WHEN $5 THEN file_id END DESC, file_id ASC
LIMIT $4
"""
_KNOWN = "SELECT file_id FROM files WHERE file_id = ANY($1::text[]) AND event_id IS NOT NULL"
_USAGE = """
SELECT file_id, bytes FROM files
WHERE principal IS NOT DISTINCT FROM $1 AND event_id IS NOT NULL AND deleted_at IS NULL
"""


@dataclass(slots=True, frozen=True)
class FileLimits:
    max_file_bytes: int = 200 << 20
    max_batch_lines: int = 50_000
    max_batch_line_bytes: int = 8 << 20
    max_files_per_principal: int = 1000
    max_bytes_per_principal: int = 1 << 30


new_file_id = FILE_IDS.new
valid_id = FILE_IDS.valid


@dataclass(slots=True, frozen=True)
class StoredFile:
    file_id: str
    principal: str | None
    filename: str
    purpose: str
    bytes: int
    created_at: int
    deleted: bool = False

    def as_object(self) -> dict[str, Any]:
        """The OpenAI FileObject."""
        return {"id": self.file_id, "object": "file", "bytes": self.bytes, "created_at": self.created_at,
                "filename": self.filename, "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}


def _from_row(row: asyncpg.Record) -> StoredFile:
    if row["event_id"] is None or row["deleted_at"] is not None:
        return StoredFile(row["file_id"], row["principal"], "", "", 0, 0, deleted=True)
    return StoredFile(row["file_id"], row["principal"], row["filename"], row["purpose"], row["bytes"],
                      row["created_at"])


def not_found(file_id: str, param: str = "file_id") -> ServingError:
    """The one answer for a file this caller may not have: unknown, deleted or another principal's.
    `param` names the request's field that held the id (`input_file_id` when creating a batch)."""
    shown = file_id if valid_id(file_id) else wire.bounded_text(file_id, 64)
    return ServingError(404, ErrorCode.FILE_NOT_FOUND, f"No file found with id '{shown}'.", param=param,
                        context={"detail": "unknown, deleted or another principal's file"})


def too_large(message: str, param: str = "file") -> ServingError:
    return ServingError(413, ErrorCode.REQUEST_TOO_LARGE, message, param=param)


# A batch line's custom_id, at most: the ledger indexes it (one row per batch and custom_id), and an
# index entry holds at most 2,704 bytes (512 characters are at most 2,048 bytes of UTF-8).
MAX_CUSTOM_ID_CHARS = 512


def bad_line(line: int, why: str) -> ServingError:
    return ServingError(400, ErrorCode.INVALID_REQUEST,
                        f"Line {line} of this batch file {why}; each line must be one JSON object.", param="file")


class JsonlCheck:
    """A purpose=batch file's lines as they stream: at most `max_lines` of at most `max_line_bytes`
    each, every one a JSON object. `feed` raises at the first problem (blank lines count as bad)."""

    def __init__(self, max_lines: int, max_line_bytes: int) -> None:
        self.max_lines, self.max_line_bytes = max_lines, max_line_bytes
        self.lines = 0
        self._line = bytearray()

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) >= 0:
            self._take(chunk[start:end])
            self._check(bytes(self._line))
            self._line.clear()
            start = end + 1
        self._take(chunk[start:])

    def finish(self) -> None:
        if self._line:
            self._check(bytes(self._line))
            self._line.clear()
        if self.lines == 0:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, "This batch file has no lines.", param="file")

    def _take(self, piece: bytes) -> None:
        if len(self._line) + len(piece) > self.max_line_bytes:
            raise too_large(f"Line {self.lines + 1} of this batch file is over {self.max_line_bytes} bytes "
                            "(max_batch_line_bytes).")
        self._line += piece

    def _check(self, line: bytes) -> None:
        self.lines += 1
        if self.lines > self.max_lines:
            raise too_large(f"This batch file has more than {self.max_lines} lines (max_batch_lines).")
        try:
            value = msgspec.json.decode(line.rstrip(b"\r"))
        except msgspec.DecodeError:
            raise bad_line(self.lines, "is not JSON") from None
        if not isinstance(value, dict):
            raise bad_line(self.lines, "is not a JSON object")
        custom_id = value.get("custom_id")
        if isinstance(custom_id, str) and len(custom_id) > MAX_CUSTOM_ID_CHARS:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, f"Line {self.lines} of this batch file has a custom_id "
                               f"of {len(custom_id)} characters; at most {MAX_CUSTOM_ID_CHARS} are allowed.",
                               param="file")


@dataclass(slots=True)
class RecentFiles:
    """This gateway's own files until the ledger has them, and its deletions (tombstones)."""

    kept: OrderedDict[str, tuple[float, StoredFile]] = field(default_factory=OrderedDict)
    deleted: OrderedDict[str, float] = field(default_factory=OrderedDict)

    def _expire(self) -> None:
        now = time.monotonic()
        while self.kept and (len(self.kept) > _RECENT_MAX or now - next(iter(self.kept.values()))[0] > _RECENT_TTL_S):
            self.kept.popitem(last=False)
        deleted = self.deleted
        while deleted and (len(deleted) > _RECENT_MAX or now - next(iter(deleted.values())) > _RECENT_TTL_S):
            deleted.popitem(last=False)

    def put(self, stored: StoredFile) -> None:
        self.kept[stored.file_id] = (time.monotonic(), stored)
        self._expire()

    def forget(self, file_id: str) -> None:
        self.kept.pop(file_id, None)

    def delete(self, file_id: str) -> None:
        self.kept.pop(file_id, None)
        self.deleted[file_id] = time.monotonic()
        self._expire()

    def get(self, file_id: str) -> StoredFile | None:
        self._expire()
        entry = self.kept.get(file_id)
        return entry[1] if entry is not None else None

    def of(self, principal: str | None) -> list[StoredFile]:
        self._expire()
        return [stored for _, stored in self.kept.values() if stored.principal == principal]

    def was_deleted(self, file_id: str) -> bool:
        self._expire()
        return file_id in self.deleted


@dataclass(slots=True, frozen=True)
class Page:
    files: list[StoredFile]
    has_more: bool


class FileStore:
    def __init__(self, database_url: str, events: Events, js: Callable[[], JetStreamContext],
                 limits: FileLimits | None = None, projection_wait_s: float = 30.0) -> None:
        self._events = events
        self._js = js
        self.limits = limits or FileLimits()
        self.projection_wait_s = projection_wait_s
        self._recent = RecentFiles()
        self._notices = ProjectionNotices(database_url, channel=FILES_CHANNEL)
        self._uploading: dict[str | None, int] = {}  # bytes of uploads in flight, per principal
        self._ledger = LedgerPool(database_url)

    async def close(self) -> None:
        await self._notices.close()
        await self._ledger.close()

    # -- writing --------------------------------------------------------------------------------

    async def create(self, principal: str | None, filename: str, purpose: str | Callable[[], Awaitable[str]],
                     content: AsyncIterable[bytes]) -> StoredFile:
        """Store `content` as a new file of `principal`'s, within the bounds (413/400 as it streams;
        nothing of a refused upload stays stored). `purpose` may come only after the content (a
        form whose `file` part comes first, as openai-node sends it): then the batch checks run
        quietly as it streams, and their first refusal is raised once the purpose says `batch`."""
        self._events.check_room()
        purpose_after = None if isinstance(purpose, str) else purpose
        live = await self._usage(principal)
        limits = self.limits
        if len(live) + 1 > limits.max_files_per_principal:
            raise too_large(f"You have {len(live)} files; at most {limits.max_files_per_principal} are kept per "
                            "principal (max_files_per_principal): delete some first.")
        room = limits.max_bytes_per_principal - sum(live.values()) - self._uploading.get(principal, 0)
        check = (JsonlCheck(limits.max_batch_lines, limits.max_batch_line_bytes)
                 if purpose == "batch" or purpose_after is not None else None)
        refusal: ServingError | None = None  # the batch checks' first, while the purpose is not known
        file_id = new_file_id()
        size = 0

        def checked(step: Callable[[], None]) -> None:
            nonlocal refusal, check
            if purpose_after is None:
                step()
                return
            try:
                step()
            except ServingError as exc:
                refusal, check = exc, None

        async def bounded() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in content:
                size += len(chunk)
                self._uploading[principal] = self._uploading.get(principal, 0) + len(chunk)
                if size > limits.max_file_bytes:
                    raise too_large(f"This file is over {limits.max_file_bytes} bytes (max_file_bytes).")
                if size > room:
                    raise too_large(f"This file would take your files past {limits.max_bytes_per_principal} bytes "
                                    "together (max_bytes_per_principal): delete some first.")
                if check is not None:
                    feed = check.feed
                    await asyncio.to_thread(checked, lambda: feed(chunk))  # noqa: B023  # run at once
                yield chunk
            if check is not None:
                checked(check.finish)

        try:
            await put_stream(self._js(), topology.FILES_BUCKET, file_id, bounded())
        except BUS_ERRORS as exc:  # nothing of it stays (`put_stream`)
            raise bus_unavailable(exc, "storing a file", full=Unavailable.FILES_FULL) from None
        finally:
            left = self._uploading.get(principal, 0) - size
            if left > 0:
                self._uploading[principal] = left
            else:
                self._uploading.pop(principal, None)
        if purpose_after is not None:
            try:
                purpose = await purpose_after()
                if purpose == "batch" and refusal is not None:
                    raise refusal
            except BaseException:
                await self._discard(file_id)
                raise
        assert isinstance(purpose, str)
        stored = StoredFile(file_id, principal, filename, purpose, size, int(time.time()))
        self._recent.put(stored)
        self._events.emit(FileCreated(model="-", node="gateway", file_id=file_id, principal=principal,
                                           filename=filename, purpose=purpose, bytes=size,
                                           created_at=stored.created_at))
        return stored

    async def _discard(self, file_id: str) -> None:
        """A stored object no file was made of (its upload refused after its content): gone again."""
        with answered_as_unavailable("discarding a refused upload"), contextlib.suppress(NotFoundError):
            await (await self._store()).delete(file_id)

    async def create_output(self, principal: str | None, filename: str, content: AsyncIterable[bytes]) -> StoredFile:
        """Store a file the system made for `principal` (a batch's output or errors, purpose
        `batch_output`): bounded by what made it, not by the principal's upload quota."""
        file_id = new_file_id()
        size = 0

        async def counted() -> AsyncIterator[bytes]:
            nonlocal size
            async for chunk in content:
                size += len(chunk)
                yield chunk

        await put_stream(self._js(), topology.FILES_BUCKET, file_id, counted())
        stored = StoredFile(file_id, principal, filename, "batch_output", size, int(time.time()))
        self._recent.put(stored)
        self._events.emit(FileCreated(model="-", node="gateway", file_id=file_id, principal=principal,
                                           filename=filename, purpose=stored.purpose, bytes=size,
                                           created_at=stored.created_at))
        return stored

    async def delete(self, file_id: str, principal: str | None) -> StoredFile:
        """Delete one of `principal`'s files: its content now, its row once the recorder projects it."""
        stored = await self.get(file_id, principal)
        self._events.check_room()
        with answered_as_unavailable("deleting a file", full=Unavailable.FILES_FULL):
            store = await self._store()
            try:
                await store.delete(file_id)
            except NotFoundError:
                pass  # deleted by a request racing this one
            except BUS_ERRORS as exc:
                if not is_stream_full(exc):
                    raise
                # A full bucket refused the deletion's marker; the chunks went all the same (nats-py
                # purges them whatever the marker did), so there is room for it now.
                with contextlib.suppress(NotFoundError):
                    await store.delete(file_id)
        self._recent.delete(file_id)
        self._events.emit(FileDeleted(model="-", node="gateway", file_id=file_id, principal=principal))
        return stored

    # -- reading --------------------------------------------------------------------------------

    async def content(self, file_id: str, principal: str | None) -> tuple[StoredFile, AsyncIterator[bytes]]:
        stored = await self.get(file_id, principal)
        with answered_as_unavailable("reading a file"):
            try:
                info = await (await self._store()).get_info(file_id)
            except NotFoundError:
                raise not_found(file_id) from None
        if info.deleted:
            raise not_found(file_id)
        return stored, read_stream(self._js(), info)

    async def get(self, file_id: str, principal: str | None, param: str = "file_id") -> StoredFile:
        if not valid_id(file_id):
            raise not_found(file_id, param)
        stored = await self._read(file_id, principal)
        if stored is None or stored.deleted or self._recent.was_deleted(file_id) or stored.principal != principal:
            raise not_found(file_id, param)
        return stored

    async def page(self, principal: str | None, limit: int, after: str | None, descending: bool,
                   purpose: str | None) -> Page:
        """`principal`'s live files after the cursor `after`, newest first if `descending`."""
        unprojected = await self._unprojected(principal)  # first: see `_usage`
        rows = await self._fetch(_PAGE, principal, purpose, after, limit + 1, descending)
        found = {row["file_id"]: _from_row(row) for row in rows}
        for stored in unprojected:
            if (stored.file_id not in found and (purpose is None or stored.purpose == purpose)
                    and (after is None or (stored.file_id < after if descending else stored.file_id > after))):
                found[stored.file_id] = stored
        files = sorted((f for f in found.values() if not self._recent.was_deleted(f.file_id)),
                       key=lambda f: f.file_id, reverse=descending)
        return Page(files[:limit], len(files) > limit)

    async def _usage(self, principal: str | None) -> dict[str, int]:
        """Bytes of each of `principal`'s live files, as far as this gateway knows. This gateway's
        unprojected files are read before the ledger's: one the recorder projects between the two
        reads is then in the second (read the other way round, it would be in neither, and the
        principal's caps would let one more file in)."""
        unprojected = await self._unprojected(principal)
        live = {row["file_id"]: row["bytes"] for row in await self._fetch(_USAGE, principal)}
        live |= {f.file_id: f.bytes for f in unprojected}
        return {file_id: size for file_id, size in live.items() if not self._recent.was_deleted(file_id)}

    async def _unprojected(self, principal: str | None) -> list[StoredFile]:
        """This gateway's recent files of `principal` the ledger does not have yet (the ones it has
        are forgotten here: from now on the ledger says whether they exist)."""
        recent = self._recent.of(principal)
        if not recent:
            return []
        known = {row["file_id"] for row in await self._fetch(_KNOWN, [f.file_id for f in recent])}
        for file_id in known:
            self._recent.forget(file_id)
        return [f for f in recent if f.file_id not in known]

    async def _read(self, file_id: str, principal: str | None) -> StoredFile | None:
        """The file from the ledger, else this gateway's recent ones, else (made moments ago,
        through another gateway) from the ledger once the recorder announces it."""
        return await self._notices.read_when_projected(file_id, FILE_IDS.made_at_s(file_id), self.projection_wait_s,
                                                       lambda: self._one_or_recent(file_id), principal)

    async def _one_or_recent(self, file_id: str) -> StoredFile | None:
        rows = await self._fetch(_ONE, file_id)
        return _from_row(rows[0]) if rows else self._recent.get(file_id)

    async def _fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        return await self._ledger.fetch(query, *args)

    async def _store(self) -> ObjectStore:
        return await self._js().object_store(topology.FILES_BUCKET)

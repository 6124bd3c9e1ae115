"""A principal's files as a gateway counts them (its quota) and lists them, on a real ledger, when
the recorder projects a file of this gateway's between the gateway's two reads (its own recent
files, then the ledger's rows): the file is counted and listed once, never missed."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncpg

from apps.bus.events import FileCreated, event_kind
from apps.bus.topology import event_subject
from apps.embedded.postgres import PostgresServer
from apps.gateway.file_store import FileStore, StoredFile, new_file_id
from apps.recorder.projector import project
from tests.support import migrated_database

PRINCIPAL = "alice"


async def _project(database_url: str, stored: StoredFile) -> None:
    """What the recorder does with the file.created event the gateway emitted for `stored`."""
    event = FileCreated(model="-", node="gateway", file_id=stored.file_id, principal=stored.principal,
                        filename=stored.filename, purpose=stored.purpose, bytes=stored.bytes,
                        created_at=stored.created_at)
    connection = await asyncpg.connect(database_url)
    try:
        await project(connection, [(event_subject(event_kind(event), event.model), event)])
    finally:
        await connection.close()


def _store_projecting_after_first_read(database_url: str, stored: StoredFile) -> FileStore:
    """A gateway's file store (reads only) that has just made `stored`; the recorder projects it
    as the store's first ledger read of a request returns."""
    store = FileStore(database_url, events=None, js=None)  # type: ignore[arg-type]  # nothing is written
    store._recent.put(stored)
    read = store._fetch
    projected = False

    async def read_then_project(query: str, *args: Any) -> list[asyncpg.Record]:
        nonlocal projected
        rows = await read(query, *args)
        if not projected:
            projected = True
            await _project(database_url, stored)
        return rows

    store._fetch = read_then_project  # type: ignore[method-assign]
    return store


def test_a_file_projected_between_the_two_reads_is_counted_and_listed(postgres: PostgresServer) -> None:
    async def main() -> None:
        database_url = await migrated_database(postgres, "file_usage")
        for read in ("usage", "page"):
            stored = StoredFile(new_file_id(), PRINCIPAL, f"{read}.txt", "user_data", 10, int(time.time()))
            store = _store_projecting_after_first_read(database_url, stored)
            try:
                if read == "usage":  # what the count and bytes caps check
                    assert (await store._usage(PRINCIPAL)).get(stored.file_id) == 10
                else:
                    page = await store.page(PRINCIPAL, 10, None, True, None)
                    assert stored.file_id in [f.file_id for f in page.files]
            finally:
                await store.close()

    asyncio.run(main())

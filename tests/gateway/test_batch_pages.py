"""A batch's output and error files are written from the ledger a page at a time: every answered
line once, in line order, the others apart, each page within its line count and byte budget
(one line past the budget still makes a page of its own). On a real ledger, the lines projected
by the recorder's own projector."""

from __future__ import annotations

import asyncio

import asyncpg

from apps.bus.events import event_kind
from apps.bus.topology import event_subject
from apps.embedded.postgres import PostgresServer
from apps.gateway.batch_lines import line_error, line_event
from apps.gateway.batch_store import BatchStore
from apps.recorder.projector import project
from tests.support import migrated_database

BATCH = "batch_" + "ab" * 22


def test_pages_hold_every_line_once_in_order_within_their_bounds(postgres: PostgresServer) -> None:
    async def main() -> None:
        database_url = await migrated_database(postgres, "batch_pages")
        events = []
        for line in range(1, 41):
            if line % 5 == 0:
                events.append(line_event(BATCH, line, f"c{line}", error=line_error("invalid_request", "bad")))
            else:  # one answer far larger than the others
                text = "x" * (50_000 if line == 7 else 100)
                events.append(line_event(BATCH, line, f"c{line}", 200, f"r{line}", {"text": text}))
        connection = await asyncpg.connect(database_url)
        try:
            await project(connection, [(event_subject(event_kind(e), e.model), e) for e in events])
        finally:
            await connection.close()
        store = BatchStore(database_url, events=None, js=None)  # type: ignore[arg-type]  # reads only
        try:
            answered = [[row["line"] for row in page]
                        async for page in store.line_pages(BATCH, True, page=8, page_bytes=4096)]
            failed = [[row["line"] for row in page] async for page in store.line_pages(BATCH, False, page=3)]
        finally:
            await store.close()
        assert [line for page in answered for line in page] == [n for n in range(1, 41) if n % 5]
        assert all(len(page) <= 8 for page in answered)
        assert [7] in answered  # past the byte budget alone: a page of its own
        assert failed == [[5, 10, 15], [20, 25, 30], [35, 40]]

    asyncio.run(main())

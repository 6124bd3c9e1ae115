"""A full files bucket on a real NATS server and a real ledger: an upload past `files_max_bytes`
is a 503 `files_full` naming the store, not an internal error, and leaves nothing of itself; the
files stored before it are read back whole."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from apps.bus import connection
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.topology import FILES_BUCKET, BusLimits
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.gateway.file_store import FileStore
from tests.support import Emitted, declared, migrated_database

FILE_BYTES = 96 << 10



async def _content(size: int) -> AsyncIterator[bytes]:
    for start in range(0, size, 16 << 10):
        yield bytes([start % 251]) * min(16 << 10, size - start)


def test_an_upload_into_a_full_files_bucket_is_a_503_and_leaves_nothing(
        tmp_path: Path, postgres: PostgresServer) -> None:
    with NatsServer(tmp_path / "nats") as server:
        declared(server, BusLimits(files_max_bytes=256 << 10))
        asyncio.run(_fill(server.url, postgres))


async def _fill(nats_url: str, postgres: PostgresServer) -> None:
    nc = await connection.connect(nats_url, "file-store-full", max_reconnect_attempts=0)
    js = nc.jetstream()
    emitted = Emitted()
    store = FileStore(await migrated_database(postgres, "files_full"), emitted, lambda: js)
    try:
        kept = [await store.create("alice", f"{name}.txt", "user_data", _content(FILE_BYTES)) for name in "ab"]
        with pytest.raises(ServingError) as refused:
            await store.create("alice", "c.txt", "user_data", _content(FILE_BYTES))
        assert (refused.value.status, refused.value.code) == (503, ErrorCode.FILES_FULL)
        assert len(emitted.events) == 2  # the refused one was never announced
        bucket = await js.object_store(FILES_BUCKET)
        assert sorted(info.name for info in await bucket.list()) == sorted(f.file_id for f in kept)
        whole = b"".join([chunk async for chunk in _content(FILE_BYTES)])
        assert all([(await bucket.get(f.file_id)).data == whole for f in kept])
    finally:
        await store.close()
        await nc.close()

"""Bus failures under a request, on a real NATS server and a real ledger, answered as 503s naming
the bus or what is full, never a bare 500: a full files bucket (the upload leaves nothing of
itself, the files before it stay whole), files read or deleted while NATS is down (a batch runner
reading its input then retries later: only a file that is gone fails its batch), a batch that
cannot be queued (it ends failed, not live for good), a model looked up while NATS is down, and an
object whose chunks stop coming (the read ends, it does not hang)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import nats.errors
import pytest

from apps.bus import connection
from apps.bus.codes import ErrorCode, ServingError
from apps.bus.events import BatchCreated, BatchStatus
from apps.bus.object_streams import put_stream, read_stream
from apps.bus.topology import BATCHES_STREAM, FILES_BUCKET, BusLimits
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.gateway.batch_runner import BatchRunner
from apps.gateway.batch_store import BatchStore, StoredBatch
from apps.gateway.bus_client import GatewayBus
from apps.gateway.cold_start import ColdStarts
from apps.gateway.file_store import FileStore, new_file_id
from apps.gateway.metrics import GatewayMetrics
from apps.gateway.node_registry import NodeRegistry
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
        # Full to the last bytes: deleting a file (which asks for room for its deletion's marker)
        # still works, and frees its room.
        while True:
            try:
                await store.create("alice", "tiny.txt", "user_data", _content(1))
            except ServingError as exc:
                assert exc.code == ErrorCode.FILES_FULL
                break
        await store.delete(kept[0].file_id, "alice")
        assert kept[0].file_id not in {info.name for info in await bucket.list() if not info.deleted}
        assert (await store.create("alice", "c.txt", "user_data", _content(FILE_BYTES // 2))).bytes == FILE_BYTES // 2
    finally:
        await store.close()
        await nc.close()


def test_files_read_or_deleted_while_nats_is_down_are_503s_naming_the_bus(
        tmp_path: Path, postgres: PostgresServer) -> None:
    with NatsServer(tmp_path / "nats") as server:
        declared(server)
        asyncio.run(_files_without_nats(server, postgres))


async def _files_without_nats(server: NatsServer, postgres: PostgresServer) -> None:
    nc = await connection.connect(server.url, "files-without-nats")
    js = nc.jetstream(timeout=1.0)  # the bus's calls fail in a second, not the default five
    emitted = Emitted()
    store = FileStore(await migrated_database(postgres, "files_down"), emitted, lambda: js, projection_wait_s=0.0)
    try:
        kept = await store.create("alice", "a.txt", "user_data", _content(FILE_BYTES))
        runner = BatchRunner(None, None, store, None, 1, 1 << 20, emitted.emit, GatewayMetrics())  # type: ignore[arg-type]
        gone = StoredBatch({"batch_id": "b", "principal": "alice", "input_file_id": new_file_id()})
        assert await runner._input(gone) is None  # a file that is not there: the batch fails
        server.stop()
        batch = StoredBatch({"batch_id": "b", "principal": "alice", "input_file_id": kept.file_id})
        for doing in (store.content(kept.file_id, "alice"), store.delete(kept.file_id, "alice"), runner._input(batch)):
            with pytest.raises(ServingError) as refused:
                await doing
            assert (refused.value.status, refused.value.code) == (503, ErrorCode.BUS_UNAVAILABLE)
        assert len(emitted.events) == 1  # no deletion announced
    finally:
        await store.close()
        with contextlib.suppress(OSError, nats.errors.Error):  # its server is gone
            await nc.close()


def test_a_batch_that_cannot_be_queued_ends_failed_and_is_a_503(tmp_path: Path, postgres: PostgresServer) -> None:
    with NatsServer(tmp_path / "nats") as server:
        declared(server)
        asyncio.run(_batch_without_queue(server.url, postgres))


async def _batch_without_queue(nats_url: str, postgres: PostgresServer) -> None:
    nc = await connection.connect(nats_url, "batch-without-queue", max_reconnect_attempts=0)
    js = nc.jetstream()
    await js.delete_stream(BATCHES_STREAM)  # what an operator's mistake or a lost stream leaves
    emitted = Emitted()
    store = BatchStore(await migrated_database(postgres, "batch_down"), emitted, lambda: js)  # type: ignore[arg-type]
    try:
        with pytest.raises(ServingError) as refused:
            await store.create("alice", "file-x", "/v1/chat/completions", "24h", None, live_cap=10)
        assert (refused.value.status, refused.value.code) == (503, ErrorCode.BUS_UNAVAILABLE)
        created, ended = emitted.events
        assert isinstance(created, BatchCreated) and isinstance(ended, BatchStatus)
        assert (ended.batch_id, ended.status) == (created.batch_id, "failed")
        assert ended.errors and ended.errors[0]["code"] == "not_queued"
    finally:
        await store.close()
        await nc.close()


def test_a_model_looked_up_while_nats_is_down_is_a_503_naming_the_bus(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as server:
        declared(server)
        asyncio.run(_lookup_without_nats(server))


async def _lookup_without_nats(server: NatsServer) -> None:
    bus = await GatewayBus.connect(server.url, BusLimits(), GatewayMetrics())
    registry = NodeRegistry(bus, BusLimits())
    registry.start()
    try:
        await registry.live_nodes()  # the watch has read the (empty) registry
        server.stop()
        with pytest.raises(ServingError) as refused:
            await ColdStarts(bus, registry, GatewayMetrics()).nodes_for("never-served")
        assert (refused.value.status, refused.value.code) == (503, ErrorCode.BUS_UNAVAILABLE)
    finally:
        await registry.stop()
        with contextlib.suppress(OSError, nats.errors.Error):  # its server is gone
            await bus.close()


def test_an_object_whose_chunks_stop_coming_ends_its_read(tmp_path: Path) -> None:
    with NatsServer(tmp_path / "nats") as server:
        declared(server)
        asyncio.run(_chunks_gone(server.url))


async def _chunks_gone(nats_url: str) -> None:
    nc = await connection.connect(nats_url, "chunks-gone", max_reconnect_attempts=0)
    js = nc.jetstream()
    try:
        await put_stream(js, FILES_BUCKET, "object", _content(FILE_BYTES))
        bucket = await js.object_store(FILES_BUCKET)
        info = await bucket.get_info("object")
        # The chunks purged under a reader that has its description (a delete racing a download).
        await js.purge_stream(f"OBJ_{FILES_BUCKET}", subject=f"$O.{FILES_BUCKET}.C.{info.nuid}")
        with pytest.raises(TimeoutError):
            async for _ in read_stream(js, info, chunk_wait_s=1.0):
                pass
    finally:
        await nc.close()

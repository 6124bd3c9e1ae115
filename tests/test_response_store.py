"""The gateway's stored-response reads on a real PostgreSQL: the ledger is the authority, this
gateway's own recent responses bridge the recorder's lag, a fresh id from elsewhere is waited for
and an old unknown one is not, and ownership is checked on every read."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from apps.bus import wire
from apps.bus.codes import ServingError
from apps.bus.topology import event_subject
from apps.embedded.postgres import PostgresServer
from apps.gateway.response_store import ResponseStore, StoredResponse, created_at_s, new_response_id
from apps.recorder.migrate import migrate
from apps.recorder.projector import project


class Emitted:
    """Stands in for the gateway's event publisher: keeps what the store emits."""

    def __init__(self) -> None:
        self.events: list[wire.AnyEvent] = []

    def emit(self, event: wire.AnyEvent) -> None:
        self.events.append(event)


@pytest.fixture
async def database_url(postgres: PostgresServer) -> AsyncIterator[str]:
    name = f"store_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres.url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        url = postgres.url.rsplit("/", 1)[0] + "/" + name
        await migrate(url)
        yield url
        await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()


def stored(response_id: str, principal: str | None = "alice", previous: str | None = None) -> StoredResponse:
    return StoredResponse(response_id, principal, previous,
                          [{"type": "message", "role": "user", "content": f"question {response_id}"}],
                          {"id": response_id, "model": "tiny", "status": "completed",
                           "output": [{"type": "message", "role": "assistant", "content": []}]})


async def record(url: str, events: list[wire.AnyEvent]) -> None:
    """What the recorder does with the events, so the ledger has them."""
    conn = await asyncpg.connect(url)
    try:
        await project(conn, [(event_subject(wire.event_kind(e), e.model), e) for e in events])
    finally:
        await conn.close()


def old_id(age_s: float) -> str:
    ms = int((time.time() - age_s) * 1000)
    return f"resp_{ms:012x}{uuid.uuid4().hex[12:]}"


def test_ids_say_when_they_were_made() -> None:
    assert abs(created_at_s(new_response_id()) - time.time()) < 1
    assert abs(created_at_s(old_id(60)) - (time.time() - 60)) < 1
    assert created_at_s("resp_nothex") is None and created_at_s("msg_" + uuid.uuid4().hex) is None


async def test_own_responses_are_served_before_the_ledger_has_them(database_url: str) -> None:
    emitted = Emitted()
    store = ResponseStore(database_url, emitted, projection_wait_s=0.0)  # type: ignore[arg-type]
    try:
        first, second = new_response_id(), new_response_id()
        store.keep(stored(first), "tiny")
        store.keep(stored(second, previous=first), "tiny")
        # Nothing projected yet: the conversation comes from this gateway's own cache.
        items = await store.conversation(second, "alice")
        assert [i["content"] for i in items if i["role"] == "user"] == [f"question {first}", f"question {second}"]
        with pytest.raises(ServingError) as caught:
            await store.get(first, "bob")
        assert caught.value.status == 404

        # Once recorded, the ledger answers; half the chain there and half cached works too.
        await record(database_url, emitted.events[:1])
        assert len(await store.conversation(second, "alice")) == 4
        await record(database_url, emitted.events[1:])
        fresh = ResponseStore(database_url, Emitted(), projection_wait_s=0.0)  # type: ignore[arg-type]
        try:
            assert await fresh.conversation(second, "alice") == items
            with pytest.raises(ServingError):
                await fresh.conversation(second, None)
        finally:
            await fresh.close()
    finally:
        await store.close()


async def test_a_fresh_id_from_elsewhere_is_waited_for(database_url: str) -> None:
    store = ResponseStore(database_url, Emitted(), projection_wait_s=5.0)  # type: ignore[arg-type]
    try:
        response_id = new_response_id()
        event = wire.ResponseStored(model="tiny", node="gateway", response_id=response_id, principal="alice",
                                    input_items=[], response=stored(response_id).response)
        waiting = asyncio.create_task(store.get(response_id, "alice"))
        await asyncio.sleep(0.3)
        assert not waiting.done(), "a response made a moment ago is waited for"
        await record(database_url, [event])
        assert (await asyncio.wait_for(waiting, 5)).response_id == response_id

        started = time.monotonic()
        with pytest.raises(ServingError) as caught:
            await store.get(old_id(60), "alice")
        assert caught.value.status == 404 and time.monotonic() - started < 2, "an old unknown id is not waited for"
    finally:
        await store.close()


async def test_a_deletion_hides_the_response_at_once_here_and_once_recorded_everywhere(database_url: str) -> None:
    emitted = Emitted()
    store = ResponseStore(database_url, emitted, projection_wait_s=0.0)  # type: ignore[arg-type]
    other = ResponseStore(database_url, Emitted(), projection_wait_s=0.0)  # type: ignore[arg-type]
    try:
        response_id = new_response_id()
        store.keep(stored(response_id), "tiny")
        await record(database_url, emitted.events)
        await store.delete(response_id, "alice")
        with pytest.raises(ServingError):
            await store.get(response_id, "alice")
        assert (await other.get(response_id, "alice")).response_id == response_id  # not recorded yet
        await record(database_url, emitted.events[1:])
        with pytest.raises(ServingError):
            await other.get(response_id, "alice")
        assert isinstance(emitted.events[1], wire.ResponseDeleted)
    finally:
        await store.close()
        await other.close()


async def test_an_unreachable_ledger_is_503_unless_the_response_is_this_gateways(postgres: PostgresServer) -> None:
    emitted = Emitted()
    store = ResponseStore("postgresql://nobody:wrong@127.0.0.1:1/none", emitted,  # type: ignore[arg-type]
                          projection_wait_s=0.0)
    try:
        mine = new_response_id()
        store.keep(stored(mine), "tiny")
        assert (await store.get(mine, "alice")).response_id == mine
        with pytest.raises(ServingError) as caught:
            await store.get(new_response_id(), "alice")
        assert caught.value.status == 503 and caught.value.retry_after_s
    finally:
        await store.close()

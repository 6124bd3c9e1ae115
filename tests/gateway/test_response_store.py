"""The gateway's stored-response reads on a real PostgreSQL: the ledger is the authority, this
gateway's own recent responses bridge the recorder's lag, a fresh id from elsewhere is waited for
and an old unknown one is not, and ownership is checked on every read."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest

from apps.bus.codes import ServingError
from apps.bus.events import AnyEvent, ResponseDeleted, ResponseStored, event_kind
from apps.bus.topology import event_subject
from apps.embedded.postgres import PostgresServer
from apps.gateway.api import responses_schema as rs
from apps.gateway.response_store import (
    MAX_UNSTORED_IDS,
    NewResponse,
    RecentResponses,
    ResponseStore,
    StoredResponse,
    StoreLimits,
    created_at_s,
    new_response_id,
    valid_id,
)
from apps.recorder.migrate import migrate
from apps.recorder.projector import project
from tests.support import Emitted, LoopTurns, eventually_async


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


def stored(response_id: str, principal: str | None = "alice", previous: str | None = None) -> NewResponse:
    return NewResponse(response_id, principal, previous,
                          [{"type": "message", "role": "user", "content": f"question {response_id}"}],
                          {"id": response_id, "model": "tiny", "status": "completed",
                           "output": [{"type": "message", "role": "assistant", "content": []}]})


async def record(url: str, events: list[AnyEvent]) -> None:
    """What the recorder does with the events, so the ledger has them."""
    conn = await asyncpg.connect(url)
    try:
        await project(conn, [(event_subject(event_kind(e), e.model), e) for e in events])
    finally:
        await conn.close()


def old_id(age_s: float) -> str:
    ms = int((time.time() - age_s) * 1000)
    return f"resp_{ms:012x}{uuid.uuid4().hex[12:]}"


def test_ids_say_when_they_were_made() -> None:
    assert abs(created_at_s(new_response_id()) - time.time()) < 1
    assert abs(created_at_s(old_id(60)) - (time.time() - 60)) < 1
    assert created_at_s("resp_nothex") is None and created_at_s("msg_" + uuid.uuid4().hex) is None


def keep_two_turns(store: ResponseStore) -> tuple[str, str]:
    """A conversation of two responses kept in `store`'s own cache (the second answers the first)."""
    first, second = new_response_id(), new_response_id()
    store.keep(stored(first), "tiny")
    store.keep(stored(second, previous=first), "tiny")
    return first, second


async def test_own_responses_are_served_before_the_ledger_has_them(database_url: str) -> None:
    emitted = Emitted()
    store = ResponseStore(database_url, emitted, projection_wait_s=0.0)  # type: ignore[arg-type]
    try:
        first, second = keep_two_turns(store)
        # Nothing projected yet: the conversation comes from this gateway's own cache.
        items = await store.conversation(second, "alice")
        asked = [i.content for i in items if isinstance(i, rs.MessageItem) and i.role == "user"]
        assert asked == [f"question {first}", f"question {second}"]
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


async def test_a_conversation_is_decoded_a_response_at_a_time_letting_the_loop_run_between(
        database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long conversation is read in one query but decoded a response at a time, typed, with the
    event loop let go between responses; what it does not read (a summary's free-form values,
    logprobs, the echoed tools) never becomes Python objects, and the rest arrives whole."""
    emitted = Emitted()
    store = ResponseStore(database_url, emitted, projection_wait_s=0.0)  # type: ignore[arg-type]
    try:
        ids = [new_response_id() for _ in range(4)]
        for i, response_id in enumerate(ids):
            turn = stored(response_id, previous=ids[i - 1] if i else None)
            turn.input_items.insert(0, {"type": "reasoning", "summary": [{"values": list(range(1000))}]})
            turn.response["tools"] = [{"type": "function", "name": "f", "parameters": {"enum": list(range(1000))}}]
            turn.response["output"][0]["content"] = [
                {"type": "output_text", "text": f"answer {i}", "logprobs": [{"token": "a", "logprob": -1.0}]}]
            store.keep(turn, "tiny")
        await record(database_url, emitted.events)

        seen: list[int] = []
        decode = StoredResponse.items
        turns = LoopTurns()

        def counted(self: StoredResponse) -> list[rs.InputItem]:
            seen.append(turns.count)
            return decode(self)

        monkeypatch.setattr(StoredResponse, "items", counted)
        fresh = ResponseStore(database_url, Emitted(), projection_wait_s=0.0)  # type: ignore[arg-type]
        try:
            async with turns:
                items = await fresh.conversation(ids[-1], "alice")
        finally:
            await fresh.close()
        assert len(seen) == 4 and all(a < b for a, b in zip(seen, seen[1:], strict=False))
        answers = [part.text for i in items if isinstance(i, rs.MessageItem) and i.role == "assistant"
                   for part in i.content if isinstance(part, rs.OutputText)]
        assert answers == [f"answer {i}" for i in range(4)]
        assert sum(isinstance(i, rs.ReasoningItem) for i in items) == 4
    finally:
        await store.close()


async def test_a_fresh_id_from_elsewhere_is_waited_for(database_url: str) -> None:
    store = ResponseStore(database_url, Emitted(), projection_wait_s=5.0)  # type: ignore[arg-type]
    try:
        response_id = new_response_id()
        event = ResponseStored(model="tiny", node="gateway", response_id=response_id, principal="alice",
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
        assert isinstance(emitted.events[1], ResponseDeleted)
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


async def test_an_id_of_the_older_guessable_form_needs_an_owner_to_be_found(database_url: str) -> None:
    """Keyless, an id is the only key, so only today's form (128 random bits) opens a response; an
    earlier version's UUIDv7 id (one more than another of its millisecond) still opens its owner's."""
    store = ResponseStore(database_url, Emitted(), projection_wait_s=0.0)  # type: ignore[arg-type]
    try:
        legacy_keyless, legacy_owned, current = old_id(5), old_id(5), new_response_id()
        store.keep(stored(legacy_keyless, principal=None), "tiny")
        store.keep(stored(legacy_owned), "tiny")
        store.keep(stored(current, principal=None), "tiny")
        assert (await store.get(current, None)).response_id == current
        assert (await store.get(legacy_owned, "alice")).response_id == legacy_owned
        with pytest.raises(ServingError) as caught:
            await store.get(legacy_keyless, None)
        assert caught.value.status == 404
    finally:
        await store.close()


async def test_a_response_made_here_unstored_is_refused_without_waiting_for_the_ledger(database_url: str) -> None:
    """A fresh id is waited for (the recorder may not have it yet), but not one this gateway made
    with `store: false`: the ledger will never have it. (An hour's wait would time the test out.)"""
    store = ResponseStore(database_url, Emitted(), projection_wait_s=3600.0)  # type: ignore[arg-type]
    try:
        unstored = new_response_id()
        store.not_stored(unstored)
        with pytest.raises(ServingError) as caught:
            await asyncio.wait_for(store.get(unstored, None), 60)
        assert caught.value.status == 404
    finally:
        await store.close()


def test_ids_carry_128_fresh_random_bits_after_their_time() -> None:
    """The id is the capability: ids made in the same millisecond share their time prefix and
    nothing else, so neither a neighbour's id nor a creation time leads to another's id."""
    ids = [new_response_id() for _ in range(2000)]
    assert all(len(i) == len("resp_") + 12 + 32 and valid_id(i) for i in ids)
    by_ms: dict[str, list[int]] = {}
    for i in ids:
        by_ms.setdefault(i[5:17], []).append(int(i[17:], 16))
    same_ms = max(by_ms.values(), key=len)
    assert len(same_ms) > 1, "ids of one millisecond"
    assert len(set(same_ms)) == len(same_ms)
    # Fresh draws differ in about half of 128 bits; a counter (previous + 1) differs in one or two.
    assert min(bin(a ^ b).count("1") for a, b in zip(same_ms, same_ms[1:], strict=False)) > 20
    assert not valid_id("resp_" + "0" * 43) and not valid_id("resp_" + "g" * 44) and not valid_id("x" * 5000)


def test_the_cache_is_bounded_in_bytes_and_forgets_by_age(monkeypatch: pytest.MonkeyPatch) -> None:
    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    recent = RecentResponses(max_bytes=10_000, ttl_s=60.0)
    for i in range(30):
        recent.put(StoredResponse(f"resp_{i}", "alice", None, b"[]", b"{" + b" " * 996 + b"}"))
    assert recent.bytes <= 10_000 and len(recent.kept) == 10
    assert recent.get("resp_0") is None and recent.get("resp_29") is not None
    recent.put(StoredResponse("huge", "alice", None, b"[]", b"{" + b" " * 19_996 + b"}"))
    assert recent.get("huge") is None and recent.bytes <= 10_000
    now[0] += 61.0
    assert recent.get("resp_29") is None and recent.bytes == 0 and not recent.kept
    # Ids of responses made unstored here are bounded in number too, and never push out a deletion.
    recent.delete("resp_deleted")
    for i in range(MAX_UNSTORED_IDS + 5):
        recent.mark_unstored(f"resp_unstored_{i}")
    assert len(recent.unstored) == MAX_UNSTORED_IDS
    assert not recent.has_none("resp_unstored_4") and recent.has_none(f"resp_unstored_{MAX_UNSTORED_IDS + 4}")
    assert recent.was_deleted("resp_deleted")


async def test_a_conversation_past_its_limits_is_refused_before_it_is_loaded(database_url: str) -> None:
    emitted = Emitted()
    limits = StoreLimits(max_chain_responses=5, max_chain_bytes=200_000)
    writer = ResponseStore(database_url, emitted, projection_wait_s=0.0, limits=limits)
    ids = [new_response_id() for _ in range(8)]
    for i, response_id in enumerate(ids):
        writer.keep(stored(response_id, previous=ids[i - 1] if i else None), "tiny")
    await record(database_url, emitted.events)
    await writer.close()
    store = ResponseStore(database_url, Emitted(), projection_wait_s=0.0, limits=limits)  # type: ignore[arg-type]
    try:
        assert len(await store.conversation(ids[4], "alice")) == 5 * 2  # five turns: the limit
        with pytest.raises(ServingError) as caught:
            await store.conversation(ids[5], "alice")
        assert (caught.value.status, caught.value.param) == (400, "previous_response_id")
        assert "at most 5 responses" in caught.value.message
        conn = await asyncpg.connect(database_url)
        try:
            three = await conn.fetchval("SELECT sum(stored_bytes) FROM responses WHERE response_id = ANY($1)", ids[:3])
        finally:
            await conn.close()
        small = ResponseStore(database_url, Emitted(), projection_wait_s=0.0,  # type: ignore[arg-type]
                              limits=StoreLimits(max_chain_bytes=three))
        try:
            assert len(await small.conversation(ids[2], "alice")) == 3 * 2
            with pytest.raises(ServingError) as caught:
                await small.conversation(ids[3], "alice")
            assert caught.value.status == 400 and "stored bytes" in caught.value.message
        finally:
            await small.close()
    finally:
        await store.close()


async def test_a_nul_in_a_kept_response_is_kept_as_the_ledger_records_it(database_url: str) -> None:
    emitted = Emitted()
    store = ResponseStore(database_url, emitted, projection_wait_s=0.0)  # type: ignore[arg-type]
    try:
        plain, with_nul = new_response_id(), new_response_id()
        for response_id, text in ((plain, "a \\u0000 spelled out"), (with_nul, "a\x00b")):
            new = stored(response_id)
            new.response["output"][0]["content"] = [{"type": "output_text", "text": text}]
            store.keep(new, "tiny")
        texts = [json.loads((await store.get(r, "alice")).response_json)["output"][0]["content"][0]["text"]
                 for r in (plain, with_nul)]
        assert texts == ["a \\u0000 spelled out", "a\ufffdb"]
        assert [e.response["output"][0]["content"][0]["text"] for e in emitted.events] == texts
    finally:
        await store.close()


async def test_another_principals_read_loads_nothing_of_what_a_response_holds(database_url: str) -> None:
    """The owner check is in the query: a read of alice's conversation as bob (or keyless) is the
    same 404 as ever, and the ledger sends back who owns the head and none of its content, nor
    walks on to its predecessors; alice's read of it loads it whole."""
    emitted = Emitted()
    writer = ResponseStore(database_url, emitted, projection_wait_s=0.0)  # type: ignore[arg-type]
    first, second = keep_two_turns(writer)
    await record(database_url, emitted.events)
    await writer.close()
    store = ResponseStore(database_url, Emitted(), projection_wait_s=0.0)  # type: ignore[arg-type]
    loaded: list[list[StoredResponse]] = []
    query = store._query

    async def spy(*args: object) -> list[StoredResponse]:
        rows = await query(*args)  # type: ignore[arg-type]
        loaded.append(rows)
        return rows

    store._query = spy  # type: ignore[method-assign]
    try:
        for principal in ("bob", None):
            for read in (store.get, store.conversation):
                with pytest.raises(ServingError) as caught:
                    await read(second, principal)
                assert caught.value.status == 404
        assert [[(s.response_id, s.principal, s.size) for s in rows] for rows in loaded] == \
            [[(second, "alice", len(b"[]{}"))]] * 4
        loaded.clear()
        assert len(await store.conversation(second, "alice")) == 4
        assert [s.response_id for s in loaded[0]] == [second, first]
        assert all(s.size > 100 for s in loaded[0])
    finally:
        await store.close()


async def test_a_conversation_through_a_deleted_response_is_gone_with_it(database_url: str) -> None:
    emitted = Emitted()
    store = ResponseStore(database_url, emitted, projection_wait_s=0.0)  # type: ignore[arg-type]
    try:
        first, second = keep_two_turns(store)
        await record(database_url, emitted.events)
        await store.delete(first, "alice")
        await record(database_url, emitted.events[2:])
        fresh = ResponseStore(database_url, Emitted(), projection_wait_s=0.0)  # type: ignore[arg-type]
        try:
            assert (await fresh.get(second, "alice")).response_id == second
            with pytest.raises(ServingError) as caught:
                await fresh.conversation(second, "alice")
            assert (caught.value.status, caught.value.param) == (404, "previous_response_id")
            assert first in caught.value.message
        finally:
            await fresh.close()
    finally:
        await store.close()


async def test_a_read_from_elsewhere_waits_for_the_recorders_notice_not_by_polling(database_url: str) -> None:
    """Listening, the waiting read queries the ledger on arrival and on the recorder's notice only,
    however long the recorder takes."""
    store = ResponseStore(database_url, Emitted(), projection_wait_s=600.0)  # type: ignore[arg-type]
    queries = 0
    query = store._query

    async def counted(*args: object) -> list[StoredResponse]:
        nonlocal queries
        queries += 1
        return await query(*args)  # type: ignore[arg-type]

    store._query = counted  # type: ignore[method-assign]
    try:
        response_id = new_response_id()
        waiting = asyncio.create_task(store.get(response_id, "alice"))
        # The waiter counts itself before its listening connection is up: wait for both.
        await eventually_async(lambda: store._notices.waiters == 1 and store._notices.listening, 10,
                               message="the read waits, listening")
        event = ResponseStored(model="tiny", node="gateway", response_id=response_id, principal="alice",
                                    input_items=[], response=stored(response_id).response)
        await record(database_url, [event])
        assert (await asyncio.wait_for(waiting, 30)).response_id == response_id
        assert queries <= 3
    finally:
        await store.close()


"""Least privilege on the real servers: each app's NATS user and PostgreSQL role can do its own
role's work and nothing the other roles own (`apps.bus.roles`, migrations/0007_app_roles.sql)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import asyncpg
import msgspec
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.subscription import Subscription

from apps.bus import connection, declaration, event_publish, roles, topology, wire
from apps.bus.codes import RunStatus
from apps.bus.events import Event, event_decoder, event_kind
from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer, nats_server_binary
from apps.embedded.postgres import PostgresServer
from apps.recorder import large_events
from apps.recorder.migrate import discover, migrate
from apps.settings import migrations_dir
from engine.frontend.protocol import SamplingParams, ServiceClass
from tests.recorder.conftest import admission, finished, response_stored, started
from tests.support import REPO, eventually_async

MODEL = "roles-model"


@dataclass
class RoleClient:
    """A connection as one role's NATS user, with the server's refusals it has been sent."""

    nc: NatsClient
    refused: list[str] = field(default_factory=list)
    # What its publishes raised (a refused JetStream publish gets no acknowledgement).
    publish_errors: list[str] = field(default_factory=list)

    async def was_refused(self, what: str) -> bool:
        what = what.lower()

        async def seen() -> bool:
            return any(what in said for said in self.refused)

        await eventually_async(seen, timeout_s=10, message=lambda: f"never refused {what!r}: {self.refused}")
        return True

    async def refused_nothing(self) -> bool:
        """Nothing refused since `refused` was cleared, once the server has answered a ping."""
        await connection.reached_server(self.nc, timeout_s=5)
        return not self.refused


@asynccontextmanager
async def as_role(server: NatsServer, role: str) -> AsyncIterator[RoleClient]:
    client: list[RoleClient] = []

    async def note(exc: Exception) -> None:
        client[0].refused.append(str(exc).lower())

    nc = await connection.connect(server.url_for(role), f"test-{role}", role=role, error_cb=note,
                                max_reconnect_attempts=0)
    client.append(RoleClient(nc))
    try:
        yield client[0]
    finally:
        await nc.close()


async def _stored_on(server: NatsServer, subject: str) -> int:
    """Messages EVENTS or REQUESTS holds on `subject` (read as the administrator)."""
    nc = await nats.connect(server.url)
    try:
        stream = topology.EVENTS_STREAM if topology.kind_of_subject(subject) is not None else topology.REQUESTS_STREAM
        info = await nc.jetstream().stream_info(stream, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())
    finally:
        await nc.close()


async def _try_publish(client: RoleClient, subject: str, body: bytes) -> None:
    try:
        await client.nc.jetstream().publish(subject, body, timeout=1)
    except (TimeoutError, nats.errors.Error) as exc:
        client.publish_errors.append(repr(exc))  # a refused publish gets no acknowledgement


async def _try_event(client: RoleClient, event: Event, subject_kind: str | None = None) -> str:
    """Publish `event` as `client`'s role; returns its subject (stored there or not)."""
    subject = topology.event_subject(subject_kind or event_kind(event), event.model)
    await _try_publish(client, subject, wire.encode(event))
    return subject


async def _see(subscription: Subscription, subject: str, publisher: RoleClient, reader: RoleClient,
               publish: Callable[[], Awaitable[object]]) -> None:
    """`publish`, then read `subscription` until a message on `subject` arrives. Core delivery is
    at most once: a message not seen in 20 s is published again, twice at most; then the test fails
    saying what it saw instead. (What is tested is that `reader` may read it, not delivery.)"""
    others: list[str] = []
    for _ in range(3):
        await publish()
        try:
            while (msg := await subscription.next_msg(timeout=20)).subject != subject:
                others.append(msg.subject)
            return
        except TimeoutError:
            continue
    pytest.fail(f"no message on {subject} in 3 publishes; saw {len(others)} others (last: {others[-5:]}), "
                f"the publisher was refused {publisher.refused}, its publishes raised {publisher.publish_errors}, "
                f"the reader was refused {reader.refused}, pending {subscription.pending_msgs}")


async def test_a_worker_takes_requests_only_through_its_consumer(nats_server: NatsServer) -> None:
    request = wire.GenerateRequest(request_id="roles-1", model=MODEL, reply_subject="_INBOX.gateway.x.y.z",
                                   sampling=SamplingParams(), prompt="hi")
    async with as_role(nats_server, roles.GATEWAY) as gateway, as_role(nats_server, roles.WORKER) as worker:
        await worker.nc.subscribe(topology.request_wildcard())
        await worker.nc.subscribe(topology.request_subject(MODEL))
        assert await worker.was_refused(f'subscription to "{topology.request_wildcard()}"')
        assert await worker.was_refused(f'subscription to "{topology.request_subject(MODEL)}"')
        # Nor a look into the stream through the JetStream API.
        with pytest.raises((TimeoutError, nats.errors.Error)):
            await worker.nc.jetstream(timeout=1).get_last_msg(topology.REQUESTS_STREAM,
                                                              topology.request_subject(MODEL))
        assert await worker.was_refused("stream.msg.get.requests")

        # Its model's consumer hands it the gateway's request.
        worker.refused.clear()
        pulled = await topology.worker_puller(worker.nc, MODEL, topology.BusLimits())
        await gateway.nc.jetstream().publish(topology.request_subject(MODEL), wire.encode(request))
        (msg,) = await pulled.fetch(1, timeout=10)
        assert wire.request_decoder.decode(msg.data).request_id == "roles-1"
        await msg.ack()
        # And its model's batch consumer the batch-class ones, on their own subject.
        batch = msgspec.structs.replace(request, request_id="roles-2", service_class=ServiceClass.BATCH)
        batch_subject = topology.request_subject(MODEL, ServiceClass.BATCH)
        await worker.nc.subscribe(batch_subject)
        assert await worker.was_refused(f'subscription to "{batch_subject}"')
        worker.refused.clear()
        batch_pulled = await topology.worker_puller(worker.nc, MODEL, topology.BusLimits(), ServiceClass.BATCH)
        await gateway.nc.jetstream().publish(batch_subject, wire.encode(batch))
        (msg,) = await batch_pulled.fetch(1, timeout=10)
        assert wire.request_decoder.decode(msg.data).request_id == "roles-2"
        await msg.ack()
        assert await worker.refused_nothing()
        # A worker may not put requests on the bus: `principal` and `attempt` are the gateway's.
        await _try_publish(worker, topology.request_subject(MODEL), wire.encode(request))
        assert await worker.was_refused(f'publish to "{topology.request_subject(MODEL)}"')


async def test_no_role_reads_another_roles_inbox(nats_server: NatsServer) -> None:
    async with as_role(nats_server, roles.WORKER) as worker, as_role(nats_server, roles.GATEWAY) as gateway:
        gateway_inbox = topology.inbox_prefix(roles.GATEWAY, "gateway")
        assert gateway.nc.new_inbox().startswith(gateway_inbox + ".")
        await worker.nc.subscribe(f"{gateway_inbox}.>")
        await worker.nc.subscribe(f"{topology.inbox_root(roles.GATEWAY)}.>")
        await worker.nc.subscribe("_INBOX.>")
        assert await worker.was_refused(f'subscription to "{gateway_inbox}.>"')
        assert await worker.was_refused('subscription to "_INBOX.>"')
        # The worker's own inbox works (its requests get answers), and gateways cannot read it.
        assert (await worker.nc.jetstream().stream_info(topology.REQUESTS_STREAM)).config.name == "REQUESTS"
        await gateway.nc.subscribe(f"{topology.inbox_root(roles.WORKER)}.>")
        assert await gateway.was_refused(f'subscription to "{topology.inbox_root(roles.WORKER)}.>"')


async def test_events_come_only_from_the_role_that_owns_their_kind(nats_server: NatsServer) -> None:
    async with (as_role(nats_server, roles.WORKER) as worker, as_role(nats_server, roles.GATEWAY) as gateway,
                as_role(nats_server, roles.BENCH) as bench, as_role(nats_server, roles.RECORDER) as recorder):
        # A worker forges no stored conversation and no admission decision.
        for event in (response_stored("resp_forged", model=MODEL), admission("roles-2", model=MODEL)):
            subject = await _try_event(worker, event)
            assert await worker.was_refused(f'publish to "{subject}"')
            assert await _stored_on(nats_server, subject) == 0
        # A gateway forges no run: the run it reports for a lost worker goes under worker_lost.
        for event in (started("roles-3", model=MODEL), finished("roles-3", model=MODEL)):
            subject = await _try_event(gateway, event)
            assert await gateway.was_refused(f'publish to "{subject}"')
            assert await _stored_on(nats_server, subject) == 0
        # The recorder and the bench publish no run either.
        for client in (recorder, bench):
            subject = await _try_event(client, finished("roles-4", model=MODEL))
            assert await client.was_refused(f'publish to "{subject}"')
        # Each of them does publish its own.
        worker.refused.clear()
        gateway.refused.clear()
        owned = [(worker, started("roles-5", model=MODEL), None),
                 (worker, admission("roles-5", model=MODEL, decision="cancelled"), topology.DROPPED),
                 (gateway, admission("roles-6", model=MODEL), None),
                 (gateway, finished("roles-6", model=MODEL, status=RunStatus.ERROR), topology.WORKER_LOST)]
        for client, event, kind in owned:
            subject = await _try_event(client, event, kind)
            assert await client.refused_nothing()
            assert await _stored_on(nats_server, subject) >= 1


async def test_the_operator_reads_everything_and_writes_nothing_an_app_owns(nats_server: NatsServer) -> None:
    async with as_role(nats_server, roles.OPERATOR) as operator, as_role(nats_server, roles.WORKER) as worker:
        seen = await operator.nc.subscribe(topology.every_subject())
        await connection.reached_server(operator.nc)  # subscribed at the server before the worker publishes
        event = started("roles-7", model=MODEL)
        subject = topology.event_subject(event_kind(event), event.model)
        await _see(seen, subject, worker, operator, lambda: _try_event(worker, event))
        for subject in (topology.request_subject(MODEL), topology.event_subject("response.stored", MODEL),
                        topology.cancel_subject("roles-7")):
            await operator.nc.publish(subject, b"{}")
            assert await operator.was_refused(f'publish to "{subject}"')
        # Nor may it change a stream (only the administrator declares them).
        with pytest.raises((TimeoutError, nats.errors.Error)):
            await operator.nc.jetstream(timeout=1).purge_stream(topology.EVENTS_STREAM)
        assert await operator.was_refused("stream.purge.events")


async def test_no_app_role_may_declare_or_change_the_streams(nats_server: NatsServer) -> None:
    for role in (roles.GATEWAY, roles.WORKER, roles.RECORDER, roles.BENCH):
        async with as_role(nats_server, role) as client:
            await declaration.require_topology(client.nc.jetstream(), wait=False)  # it may look
            with pytest.raises((TimeoutError, nats.errors.Error)):
                await client.nc.jetstream(timeout=1).delete_stream(topology.REQUESTS_STREAM)
            assert await client.was_refused("stream.delete.requests")


def test_the_recorder_refuses_an_event_on_another_kinds_subject() -> None:
    stored = response_stored("resp_1", model=MODEL)
    assert roles.event_refused(topology.event_subject("response.stored", MODEL), stored) is None
    # What a worker could publish, were it to put another kind's body on its own subject.
    assert roles.event_refused(topology.event_subject("run.started", MODEL), stored) is not None
    lost = finished("r", model=MODEL, status=RunStatus.ERROR)
    assert roles.event_refused(topology.event_subject(topology.WORKER_LOST, MODEL), lost) is None
    # A gateway reports only a failed run, a worker only a dropped request.
    ok = finished("r", model=MODEL)
    assert roles.event_refused(topology.event_subject(topology.WORKER_LOST, MODEL), ok) is not None
    assert roles.event_refused(topology.event_subject(topology.DROPPED, MODEL), admission("r")) is not None
    dropped = admission("r", decision="timeout")
    assert roles.event_refused(topology.event_subject(topology.DROPPED, MODEL), dropped) is None


# -- PostgreSQL --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ledger(postgres: PostgresServer) -> PostgresServer:
    asyncio.run(migrate(postgres.url))
    asyncio.run(postgres.open_app_roles())
    return postgres


async def test_the_gateways_database_role_reads_stored_responses_and_nothing_more(ledger: PostgresServer) -> None:
    conn = await asyncpg.connect(ledger.role_url("gateway"), timeout=10)
    try:
        assert await conn.fetchval("SELECT count(*) FROM responses") >= 0
        assert await conn.fetchval("SELECT count(*) FROM files") >= 0
        refused = [
            "INSERT INTO runs (request_id, model, node, status) VALUES ('forged', 'm', 'n', 'ok')",
            "UPDATE runs SET status = 'ok'",
            "INSERT INTO responses (response_id, principal) VALUES ('resp_forged', 'alice')",
            "UPDATE responses SET principal = 'mallory'",
            "DELETE FROM responses",
            "INSERT INTO files (file_id, principal) VALUES ('file-forged', 'alice')",
            "UPDATE files SET principal = 'mallory'",
            "DELETE FROM files",
            "SELECT count(*) FROM runs",
            "CREATE TABLE mine (x int)",
        ]
        for statement in refused:
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
        # COPY … TO PROGRAM runs a shell command as the server's OS user: superusers only.
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await conn.execute("COPY (SELECT 1) TO PROGRAM 'true'")
        assert not await conn.fetchval("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
    finally:
        await conn.close()


async def test_the_recorder_writes_the_ledger_and_the_reader_only_reads_it(ledger: PostgresServer) -> None:
    recorder = await asyncpg.connect(ledger.role_url("recorder"), timeout=10)
    reader = await asyncpg.connect(ledger.role_url("reader"), timeout=10)
    try:
        async with recorder.transaction():
            await recorder.execute("INSERT INTO dead_letters (subject, reason, error, payload, payload_sha256) "
                                   "VALUES ('s', 'rejected', 'e', ''::bytea, 'roles-test')")
            assert await reader.fetchval("SELECT count(*) FROM schema_migrations") == len(discover(migrations_dir()))
            await recorder.execute("DELETE FROM dead_letters WHERE payload_sha256 = 'roles-test'")
        for conn, statement in ((reader, "DELETE FROM runs"), (reader, "INSERT INTO scores (event_id) VALUES ('x')"),
                                (recorder, "DELETE FROM schema_migrations"), (recorder, "DELETE FROM schema_functions"),
                                (recorder, "CREATE TABLE mine (x int)")):
            with pytest.raises(asyncpg.InsufficientPrivilegeError):
                await conn.execute(statement)
        with pytest.raises(asyncpg.InsufficientPrivilegeError):
            await recorder.execute("COPY (SELECT 1) TO PROGRAM 'true'")
    finally:
        await recorder.close()
        await reader.close()


def test_the_fleet_configuration_in_the_docs_is_the_one_the_roles_make(tmp_path: Path) -> None:
    """docs/operations.md shows what `helexa bus roles` prints, and nats-server takes it."""
    block = roles.authorization(("admin", "ADMIN_PASSWORD"),
                                [(role, role, f"{role.upper()}_PASSWORD") for role in roles.ROLES])
    assert block in (REPO / "docs" / "operations.md").read_text(encoding="utf-8")
    config = tmp_path / "fleet.conf"
    config.write_text(f"listen: \"127.0.0.1:{free_port()}\"\njetstream {{ store_dir: \"{tmp_path}\" }}\n{block}\n",
                      encoding="utf-8")
    checked = subprocess.run([nats_server_binary(), "-c", str(config), "-t"], capture_output=True, text=True,
                             timeout=30)
    assert checked.returncode == 0, checked.stdout + checked.stderr


async def test_a_large_event_is_recorded_only_as_its_own_role_stored_it(
        nats_server: NatsServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """The `helexa_events` bucket is written by every role that publishes events, so a worker can
    replace a gateway's large event's object; the reference's digest keeps the forgery out, and the
    recorder, as its role, reads, erases and trims what it recorded."""
    monkeypatch.setattr(event_publish, "fits", lambda *_: False)  # every event by reference
    async with as_role(nats_server, roles.GATEWAY) as gateway, as_role(nats_server, roles.WORKER) as worker, \
            as_role(nats_server, roles.RECORDER) as recorder:
        kept, replaced = response_stored("resp_kept", model=MODEL), response_stored("resp_replaced", model=MODEL)
        for event in (kept, replaced):
            assert await event_publish.publish_event(gateway.nc.jetstream(), event, required=True)
        assert await gateway.refused_nothing()
        forged = msgspec.structs.replace(replaced, principal="mallory")
        await (await worker.nc.jetstream().object_store(topology.LARGE_EVENTS_BUCKET)).put(
            replaced.event_id, wire.encode(forged))
        assert await worker.refused_nothing()

        js = recorder.nc.jetstream()
        puller = await js.pull_subscribe(topology.event_subject("response.stored", MODEL), durable=None)
        msgs = await puller.fetch(2, timeout=10)
        pending = [(msg, event_decoder.decode(msg.data)) for msg in msgs]
        assert all(roles.event_refused(msg.subject, ref) is None for msg, ref in pending)
        events, buried, later, unavailable = await large_events.resolve(js, pending, 1 << 20)
        assert [event for _, event in events] == [kept] and not later and not unavailable
        assert len(buried) == 1 and "digest" in buried[0][1].error
        store = await js.object_store(topology.LARGE_EVENTS_BUCKET)
        await store.delete(kept.event_id)
        await js.delete_msg(topology.EVENTS_STREAM, msgs[0].metadata.sequence.stream)
        await js.purge_stream(topology.EVENTS_STREAM, seq=msgs[1].metadata.sequence.stream + 1)
        assert await recorder.refused_nothing()
        assert await _stored_on(nats_server, topology.event_subject("response.stored", MODEL)) == 0


async def test_only_the_gateway_touches_uploaded_files(nats_server: NatsServer) -> None:
    """The `helexa_files` bucket (/v1/files): the gateway writes, reads and deletes it; no other
    app role may write an object there or read one out."""
    bucket = topology.FILES_BUCKET
    stream = f"OBJ_{bucket}"
    async with (as_role(nats_server, roles.WORKER) as worker, as_role(nats_server, roles.RECORDER) as recorder,
                as_role(nats_server, roles.BENCH) as bench):
        for client in (worker, recorder, bench):
            for subject in (f"$O.{bucket}.C.forged", f"$O.{bucket}.M.forged", f"$JS.API.DIRECT.GET.{stream}",
                            f"$JS.API.STREAM.PURGE.{stream}", f"$JS.API.CONSUMER.CREATE.{stream}"):
                await _try_publish(client, subject, b"{}")
                assert await client.was_refused(f'publish to "{subject}"')
    async with as_role(nats_server, roles.GATEWAY) as gateway:
        store = await gateway.nc.jetstream().object_store(bucket)
        await store.put("roles-file", b"content")
        assert (await store.get("roles-file")).data == b"content"
        await store.delete("roles-file")
        assert await gateway.refused_nothing()

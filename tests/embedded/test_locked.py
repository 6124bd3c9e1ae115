"""The embedded servers are locked: loopback only, nobody in without the generated credentials."""

from __future__ import annotations

import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import asyncpg
import nats
import psutil
import pytest

from apps.bus import connection
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer, postgres_bin, run_as


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def _listening_addresses(pid: int) -> set[str]:
    return {c.laddr.ip for c in psutil.Process(pid).net_connections(kind="inet") if c.status == psutil.CONN_LISTEN}


async def _refused(url: str) -> str:
    async def quiet(exc: Exception) -> None:
        pass

    with pytest.raises(nats.errors.Error) as refused:
        await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=5, error_cb=quiet)
    return str(refused.value)


async def test_nats_refuses_clients_without_the_credentials(nats_server: NatsServer) -> None:
    anonymous = f"nats://127.0.0.1:{nats_server.port}"
    assert "Authorization Violation" in await _refused(anonymous)
    assert "Authorization Violation" in await _refused(f"nats://helexa:wrong@127.0.0.1:{nats_server.port}")
    nc = await connection.connect(nats_server.url, "locked-test")
    try:
        await nc.flush()
        assert nc.is_connected
    finally:
        await nc.close()
    assert nats_server.process is not None
    assert _listening_addresses(nats_server.process.pid) == {"127.0.0.1"}


def test_nats_keeps_its_credentials_and_config_to_its_owner(nats_server: NatsServer) -> None:
    assert _mode(nats_server.credentials_file) == 0o600
    config = nats_server.data_dir / "nats-server.conf"
    assert _mode(config) == 0o600
    assert nats_server.credentials.password in config.read_text()
    assert nats_server.process is not None
    # The password is in the 0600 file, never on the command line other users can read.
    assert nats_server.credentials.password not in " ".join(psutil.Process(nats_server.process.pid).cmdline())


async def test_postgres_refuses_every_connection_without_the_password(postgres: PostgresServer) -> None:
    port = postgres.port
    for missing in (
        f"postgresql://postgres@127.0.0.1:{port}/postgres",  # the superuser, no password, TCP
        f"postgresql://postgres:wrong@127.0.0.1:{port}/postgres",
        f"postgresql://someone@127.0.0.1:{port}/postgres",
    ):
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
            await asyncpg.connect(missing, timeout=10)
    # The unix socket asks for the password too.
    with pytest.raises(asyncpg.InvalidPasswordError):
        await asyncpg.connect(host=str(postgres.data_dir), port=port, user="postgres", database="postgres",
                              timeout=10)
    conn = await asyncpg.connect(postgres.url)
    try:
        assert await conn.fetchval("SHOW password_encryption") == "scram-sha-256"
        assert await conn.fetchval("SHOW listen_addresses") == "127.0.0.1"
        stored = await conn.fetchval("SELECT rolpassword FROM pg_authid WHERE rolname = 'postgres'")
        assert stored.startswith("SCRAM-SHA-256$")
        methods = {r["auth_method"] for r in await conn.fetch("SELECT auth_method FROM pg_hba_file_rules")}
    finally:
        await conn.close()
    assert methods == {"scram-sha-256"}
    assert postgres.process is not None
    assert _listening_addresses(postgres.process.pid) == {"127.0.0.1"}
    assert _mode(postgres.credentials_file) == 0o600


async def test_a_cluster_made_before_the_lock_gets_a_password() -> None:
    folder = Path(tempfile.mkdtemp(prefix="helexa-pg-"))
    server = PostgresServer(folder)
    try:
        # What `helexa up` made before: an initdb with trust and no credentials file.
        user = run_as()
        server._user = user
        folder.mkdir(parents=True, exist_ok=True)
        if user:
            server._give_to_server(folder)
        subprocess.run([postgres_bin("initdb"), "-D", str(server.pgdata), "--auth=trust", "-U", "postgres"],
                       check=True, capture_output=True, user=user)
        server.start()
        with pytest.raises(asyncpg.InvalidAuthorizationSpecificationError):
            await asyncpg.connect(f"postgresql://postgres@127.0.0.1:{server.port}/postgres", timeout=10)
        conn = await asyncpg.connect(server.url)
        await conn.close()
        assert _mode(server.credentials_file) == 0o600
        # The same credentials after a restart.
        url = server.url
        server.stop()
        server.start()
        assert server.url == url
        conn = await asyncpg.connect(server.url)
        await conn.close()
    finally:
        server.stop()
        shutil.rmtree(folder, ignore_errors=True)

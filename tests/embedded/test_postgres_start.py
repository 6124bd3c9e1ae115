"""The embedded PostgreSQL's first start: an initdb that fails says why in one line and leaves no
half-made cluster, so the next start makes a whole one (a real initdb and postgres)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from apps.embedded.credentials import Credentials
from apps.embedded.postgres import PostgresServer


def test_a_failed_initdb_says_why_and_the_next_start_makes_a_whole_cluster(tmp_path: Path) -> None:
    doomed = PostgresServer(tmp_path / "pg")
    doomed._credentials = Credentials(user="pg_refused", password="unused")  # initdb refuses a pg_ name
    with pytest.raises(RuntimeError) as failed:
        doomed.start()
    message = str(failed.value)
    assert message.startswith("helexa: creating PostgreSQL's database (initdb) failed (exit 1): ")
    assert "pg_refused" in message and "\n" not in message
    assert not doomed.pgdata.exists() and not list((tmp_path / "pg").glob("pgdata*"))

    with PostgresServer(tmp_path / "pg") as server:
        async def ask() -> int:
            conn = await asyncpg.connect(server.url)
            try:
                return await conn.fetchval("SELECT 1")
            finally:
                await conn.close()
        assert asyncio.run(ask()) == 1

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


def test_an_empty_pgdata_folder_is_filled_in_place_and_one_holding_other_files_is_named(tmp_path: Path) -> None:
    (tmp_path / "mounted" / "pgdata").mkdir(parents=True)  # a volume mounted there: it cannot be renamed over
    with PostgresServer(tmp_path / "mounted") as server:
        assert (server.pgdata / "PG_VERSION").exists()

    (tmp_path / "stray" / "pgdata").mkdir(parents=True)
    (tmp_path / "stray" / "pgdata" / "notes.txt").write_text("not a database")
    with pytest.raises(RuntimeError) as refused:
        PostgresServer(tmp_path / "stray").start()
    assert "holds files but no database" in str(refused.value) and "pgdata" in str(refused.value)
    assert (tmp_path / "stray" / "pgdata" / "notes.txt").exists()  # nothing of the user's is touched

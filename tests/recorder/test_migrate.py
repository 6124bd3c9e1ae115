"""Migrations: applied once, in order, each atomically, safe to run concurrently."""

from __future__ import annotations

import asyncio
from pathlib import Path

import asyncpg
import pytest

from apps.recorder.migrate import discover, migrate
from apps.settings import migrations_dir


async def _ledger(url: str) -> list[tuple[int, str]]:
    conn = await asyncpg.connect(url)
    try:
        return [tuple(r) for r in await conn.fetch("SELECT version, name FROM schema_migrations ORDER BY version")]
    finally:
        await conn.close()


SHIPPED = ["0001_events_and_runs", "0002_admission_nodes_bench", "0003_dead_letters", "0004_run_attempts",
           "0005_responses", "0006_response_bounds", "0007_app_roles", "0008_files",
           "0009_preemptions", "0010_batches", "0011_schema_functions", "0012_run_ranks"]
LEDGER = [(int(name[:4]), name) for name in SHIPPED]
FUNCTIONS = ["functions/helexa_prune"]


async def test_applies_once_then_nothing(database_url: str) -> None:
    assert await migrate(database_url) == SHIPPED + FUNCTIONS
    assert await migrate(database_url) == []
    assert await _ledger(database_url) == LEDGER
    conn = await asyncpg.connect(database_url)
    try:
        tables = {r["tablename"]
                  for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}
    finally:
        await conn.close()
    assert {"events", "runs", "admission_events", "nodes", "bench_runs", "scores", "dead_letters", "run_attempts",
            "preemptions", "schema_migrations"} <= tables


async def test_concurrent_migrators_apply_each_file_once(database_url: str) -> None:
    results = await asyncio.gather(*(migrate(database_url) for _ in range(4)))
    assert sorted(results) == [[], [], [], SHIPPED + FUNCTIONS]
    assert await _ledger(database_url) == LEDGER


async def test_files_apply_in_order_and_a_failure_leaves_no_trace(database_url: str, tmp_path: Path) -> None:
    (tmp_path / "0002_fill.sql").write_text("INSERT INTO t VALUES (2);")
    (tmp_path / "0001_create.sql").write_text("CREATE TABLE t (v int); INSERT INTO t VALUES (1);")
    (tmp_path / "README.md").write_text("not a migration")
    assert await migrate(database_url, tmp_path) == ["0001_create", "0002_fill"]

    (tmp_path / "0003_broken.sql").write_text("INSERT INTO t VALUES (3); SELECT * FROM missing_table;")
    with pytest.raises(asyncpg.UndefinedTableError):
        await migrate(database_url, tmp_path)
    assert await _ledger(database_url) == [(1, "0001_create"), (2, "0002_fill")]
    conn = await asyncpg.connect(database_url)
    try:
        assert [r["v"] for r in await conn.fetch("SELECT v FROM t ORDER BY v")] == [1, 2]
    finally:
        await conn.close()


async def test_a_function_is_applied_again_only_when_its_file_changes(database_url: str, tmp_path: Path) -> None:
    (tmp_path / "0001_create.sql").write_text("CREATE TABLE t (v int);")
    (tmp_path / "functions").mkdir()
    definition = tmp_path / "functions" / "answer.sql"
    definition.write_text("CREATE OR REPLACE FUNCTION answer() RETURNS int LANGUAGE sql AS $$ SELECT 41 $$;")
    assert await migrate(database_url, tmp_path) == ["0001_create", "functions/answer"]
    assert await migrate(database_url, tmp_path) == []
    definition.write_text("CREATE OR REPLACE FUNCTION answer() RETURNS int LANGUAGE sql AS $$ SELECT 42 $$;")
    assert await migrate(database_url, tmp_path) == ["functions/answer"]
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT answer()") == 42
    finally:
        await conn.close()


async def test_the_ledger_prunes_with_the_one_definition_of_helexa_prune(database_url: str) -> None:
    await migrate(database_url)
    conn = await asyncpg.connect(database_url)
    try:
        source = await conn.fetchval("SELECT prosrc FROM pg_proc WHERE proname = 'helexa_prune'")
    finally:
        await conn.close()
    assert source.strip() in (migrations_dir() / "functions" / "helexa_prune.sql").read_text()


def test_duplicate_versions_are_refused(tmp_path: Path) -> None:
    (tmp_path / "0001_a.sql").write_text("")
    (tmp_path / "0001_b.sql").write_text("")
    with pytest.raises(ValueError, match="version 1"):
        discover(tmp_path)


def test_folder_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert (migrations_dir() / "0001_events_and_runs.sql").is_file()
    monkeypatch.setenv("HELEXA_MIGRATIONS_DIR", str(tmp_path))
    assert migrations_dir() == tmp_path.resolve()

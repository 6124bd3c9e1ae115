"""Schema migrations: numbered plain SQL files applied in order, each once, recorded in `schema_migrations`.

A file `migrations/0003_bench.sql` is version 3, name `0003_bench`. Each file runs in its own
transaction together with its `schema_migrations` row, so a failed migration leaves no trace.
A session-level advisory lock serializes migrators, so any number of apps may run this at start-up.

SQL functions are kept apart, one definition each under `migrations/functions/` (`CREATE OR REPLACE`),
and applied after the numbered files whenever a file's text differs from what the database last
applied (its sha256 in `schema_functions`): a migration that adds a table to `helexa_prune` adds one
line to that file instead of repeating the whole function.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from apps.settings import migrations_dir

log = logging.getLogger("helexa.recorder.migrate")

# An arbitrary constant every helexa migrator agrees on ("hlxa" in ASCII).
_LOCK_KEY = 0x686C7861
_FILE_NAME = re.compile(r"^(\d{4})_\w+\.sql$")

_CREATE_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""


# Created by migration 0011 (which also keeps the recorder from changing it); here too for a folder
# of migrations that has functions but not that migration.
_CREATE_FUNCTIONS_LEDGER = """
CREATE TABLE IF NOT EXISTS schema_functions (
    name       text PRIMARY KEY,
    sha256     text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
)
"""
_FUNCTION_APPLIED = """
INSERT INTO schema_functions (name, sha256) VALUES ($1, $2)
ON CONFLICT (name) DO UPDATE SET sha256 = excluded.sha256, applied_at = now()
"""


@dataclass(slots=True, frozen=True)
class Migration:
    version: int
    name: str
    path: Path


@dataclass(slots=True, frozen=True)
class Function:
    name: str
    sql: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def discover_functions(folder: Path) -> list[Function]:
    """The function definitions under `folder/functions`, by name (none when there is no such folder)."""
    paths = sorted((folder / "functions").glob("*.sql"))
    return [Function(f"functions/{path.stem}", path.read_text()) for path in paths]


async def _applied_functions(conn: asyncpg.Connection) -> dict[str, str]:
    if await conn.fetchval("SELECT to_regclass('schema_functions')") is None:
        return {}
    return {row["name"]: row["sha256"] for row in await conn.fetch("SELECT name, sha256 FROM schema_functions")}


def _changed(functions: list[Function], applied: dict[str, str]) -> list[Function]:
    return [f for f in functions if applied.get(f.name) != f.sha256]


def discover(folder: Path) -> list[Migration]:
    """The migrations in `folder`, by version; other files are ignored, a repeated version is an error."""
    found: dict[int, Migration] = {}
    for path in sorted(folder.glob("*.sql")):
        match = _FILE_NAME.match(path.name)
        if not match:
            continue
        version = int(match.group(1))
        if version in found:
            raise ValueError(f"two migrations with version {version}: {found[version].path.name}, {path.name}")
        found[version] = Migration(version, path.stem, path)
    return [found[v] for v in sorted(found)]


async def _applied(conn: asyncpg.Connection) -> set[int]:
    if await conn.fetchval("SELECT to_regclass('schema_migrations')") is None:
        return set()
    return {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}


async def migrate(database_url: str, folder: Path | None = None) -> list[str]:
    """Apply every migration not applied yet; returns the names applied by this call, in order.

    A database that has them all is only read, so an app whose role may not change the schema (the
    recorder's) gets through; one with migrations pending needs its owner (`helexa migrate`), and
    such a role is refused (asyncpg.InsufficientPrivilegeError).
    """
    folder = folder or migrations_dir()
    pending = discover(folder)
    functions = discover_functions(folder)
    conn = await asyncpg.connect(database_url, timeout=10)
    try:
        if ({m.version for m in pending} <= await _applied(conn)
                and not _changed(functions, await _applied_functions(conn))):
            return []
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        try:
            await conn.execute(_CREATE_LEDGER)
            done = {row["version"] for row in await conn.fetch("SELECT version FROM schema_migrations")}
            applied = []
            for migration in pending:
                if migration.version in done:
                    continue
                async with conn.transaction():
                    # No arguments: the simple query protocol, so a file may hold many statements.
                    await conn.execute(migration.path.read_text())
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)",
                        migration.version,
                        migration.name,
                    )
                log.info("migration applied", extra={"version": migration.version, "migration": migration.name})
                applied.append(migration.name)
            if functions:
                await conn.execute(_CREATE_FUNCTIONS_LEDGER)
            for function in _changed(functions, await _applied_functions(conn)):
                async with conn.transaction():
                    await conn.execute(function.sql)
                    await conn.execute(_FUNCTION_APPLIED, function.name, function.sha256)
                log.info("function applied", extra={"migration": function.name})
                applied.append(function.name)
            return applied
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    finally:
        await conn.close()

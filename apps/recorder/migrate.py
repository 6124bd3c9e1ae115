"""Schema migrations: numbered plain SQL files applied in order, each once, recorded in `schema_migrations`.

A file `migrations/0003_bench.sql` is version 3, name `0003_bench`. Each file runs in its own
transaction together with its `schema_migrations` row, so a failed migration leaves no trace.
A session-level advisory lock serializes migrators, so any number of apps may run this at start-up.
"""

from __future__ import annotations

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


@dataclass(slots=True, frozen=True)
class Migration:
    version: int
    name: str
    path: Path


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
    pending = discover(folder or migrations_dir())
    conn = await asyncpg.connect(database_url, timeout=10)
    try:
        if {m.version for m in pending} <= await _applied(conn):
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
            return applied
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    finally:
        await conn.close()

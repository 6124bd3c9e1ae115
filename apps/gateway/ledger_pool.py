"""The gateway's read connections to the ledger (stored responses, files), opened on first use, so a
gateway whose ledger is away starts and serves everything else; queries time out rather than hang."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from apps.bus.codes import Unavailable, unavailable


class LedgerPool:
    def __init__(self, database_url: str, max_size: int = 4) -> None:
        self._database_url = database_url
        self._max_size = max_size
        self._pool: asyncpg.Pool | None = None
        self._lock = asyncio.Lock()

    async def get(self) -> asyncpg.Pool:
        async with self._lock:
            if self._pool is None:
                self._pool = await asyncpg.create_pool(self._database_url, min_size=0, max_size=self._max_size,
                                                       timeout=5, command_timeout=10)
            return self._pool

    async def fetch(self, query: str, *args: Any) -> list[asyncpg.Record]:
        """The query's rows; a ledger that cannot answer is a 503 `ledger_unavailable`."""
        try:
            pool = await self.get()
            async with pool.acquire() as conn:
                return list(await conn.fetch(query, *args))
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError) as exc:
            raise unavailable(Unavailable.LEDGER_UNAVAILABLE, {"detail": f"postgres: {exc!r}"}) from None

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

"""The gateway's read connections to the ledger (stored responses, files), opened on first use, so a
gateway whose ledger is away starts and serves everything else; queries time out rather than hang."""

from __future__ import annotations

import asyncio

import asyncpg


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

    async def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            await pool.close()

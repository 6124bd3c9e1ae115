"""Waiting for the recorder's notices: the waits are bounded in all and per principal, so one key's
reads of invented fresh ids cannot take every wait from the others."""

from __future__ import annotations

from contextlib import AsyncExitStack

from apps.embedded.postgres import PostgresServer
from apps.gateway.projection_notices import ProjectionNotices


async def test_one_principal_takes_at_most_an_eighth_of_the_waits(postgres: PostgresServer) -> None:
    notices = ProjectionNotices(postgres.url, max_waiters=16)
    try:
        async with AsyncExitStack() as waits:
            mallory = [await waits.enter_async_context(notices.expecting(f"resp_{i}", "mallory")) for i in range(3)]
            assert [w is not None for w in mallory] == [True, True, False]
            assert await waits.enter_async_context(notices.expecting("resp_a", "alice")) is not None
            anonymous = [await waits.enter_async_context(notices.expecting(f"resp_n{i}")) for i in range(13)]
            assert [w is not None for w in anonymous] == [True] * 13
            # 16 in all: nobody waits past that, whoever asks.
            assert await waits.enter_async_context(notices.expecting("resp_b", "bob")) is None
            assert notices.waiters == 16
        assert notices.waiters == 0
        async with notices.expecting("resp_again", "mallory") as again:
            assert again is not None
    finally:
        await notices.close()

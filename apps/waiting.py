"""Waiting for one thing unless a stop comes first: shared by the apps' loops (any process)."""

from __future__ import annotations

import asyncio
from typing import Any


async def done_unless(task: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Until `task` is done or `stop` is set; whether `task` is done (it is left running if not).
    Cancelled itself, it cancels `task`, whose end (an error of a connection closing under it,
    say) is then nobody's to report."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        abandon(task)
        raise
    finally:
        stopping.cancel()
    return task.done()


def abandon(task: asyncio.Future[Any]) -> None:
    """Cancel `task` and let its outcome go unread without a 'never retrieved' report."""
    task.cancel()
    task.add_done_callback(_read)


def _read(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()

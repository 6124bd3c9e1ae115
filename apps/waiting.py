"""Waiting for one thing unless a stop comes first: shared by the apps' loops (any process)."""

from __future__ import annotations

import asyncio
from typing import Any


async def done_unless(task: asyncio.Future[Any], stop: asyncio.Event) -> bool:
    """Until `task` is done or `stop` is set; whether `task` is done (it is left running if not)."""
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({task, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    return task.done()

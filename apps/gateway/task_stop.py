"""Ending a background task for certain at shutdown."""

from __future__ import annotations

import asyncio


async def cancel_until_done(task: asyncio.Task, poll_s: float = 0.2) -> None:
    """Cancel `task` again until it has ended. One cancellation is not enough for a loop whose
    awaited NATS request can swallow it (Python 3.11's `wait_for` when the inner wait completes at
    that moment, or nats-py turning it into its own error, which the loop survives): the loop would
    go on, and a shutdown that awaited it would wait forever."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=poll_s)

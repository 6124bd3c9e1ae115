"""Who is told when a NATS connection is back after losing its server: a restarted server has
forgotten what the connection asked of it before (a waiting pull, `apps.bus.pull`), so whoever
waits on such a request asks again at once instead of waiting out its timeout.

`apps.bus.connection.connect` wires each connection it makes to its `Reconnects`; a connection
made any other way has one that is never told.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from nats.aio.client import Client as NatsClient


class Reconnects:
    """The listeners of one connection's reconnects (each a plain callable, called on the loop)."""

    def __init__(self) -> None:
        self._listeners: dict[Callable[[], None], None] = {}

    def add(self, listener: Callable[[], None]) -> None:
        self._listeners[listener] = None

    def discard(self, listener: Callable[[], None]) -> None:
        self._listeners.pop(listener, None)

    async def reconnected(self) -> None:
        """nats-py's `reconnected_cb`."""
        for listener in list(self._listeners):
            listener()


_reconnects: weakref.WeakKeyDictionary[NatsClient, Reconnects] = weakref.WeakKeyDictionary()


def reconnects_of(nc: NatsClient) -> Reconnects:
    found = _reconnects.get(nc)
    if found is None:
        found = _reconnects[nc] = Reconnects()
    return found


def told_on_reconnect(nc: NatsClient, reconnects: Reconnects) -> NatsClient:
    """`nc`, just connected with `reconnects.reconnected` as its reconnected callback."""
    _reconnects[nc] = reconnects
    return nc

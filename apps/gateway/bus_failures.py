"""A bus failure under a request, answered as one: a 503 naming the bus (or what is full), never a
bare 500. A 500 from the gateway means a bug; NATS restarting, a JetStream leader election, a
full stream or bucket are the operator's weather, and the client is told to retry.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import nats.errors

from apps.bus.codes import ServingError, Unavailable, unavailable
from apps.bus.publish import is_stream_full

# Every way a NATS or JetStream call fails: nats-py's own errors (timeouts, no responders, a closed
# or draining connection, a full outbound buffer, JetStream API errors) and asyncio's timeouts.
BUS_ERRORS = (nats.errors.Error, TimeoutError)


def bus_unavailable(exc: BaseException, doing: str, full: Unavailable = Unavailable.BUS_UNAVAILABLE) -> ServingError:
    """The 503 for `exc`, raised while `doing`: `full`'s when a stream or bucket refused at its
    limits, else the bus's."""
    reason = full if is_stream_full(exc) else Unavailable.BUS_UNAVAILABLE
    return unavailable(reason, {"detail": f"{doing}: {exc!r}"[:300]})


@contextmanager
def answered_as_unavailable(doing: str, full: Unavailable = Unavailable.BUS_UNAVAILABLE) -> Iterator[None]:
    """Bus failures inside as `bus_unavailable` (a ServingError raised inside goes on as it is)."""
    try:
        yield
    except ServingError:
        raise
    except BUS_ERRORS as exc:
        raise bus_unavailable(exc, doing, full) from None

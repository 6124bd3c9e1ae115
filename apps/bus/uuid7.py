"""Time-ordered ids (UUIDv7, RFC 9562 §5.7) for events, so ledger keys arrive in roughly ascending order.

Python 3.11's `uuid` has no uuid7. Layout, most significant bit first: 48 bits of Unix milliseconds,
the version (7), 12 bits `rand_a`, the variant (0b10), 62 bits `rand_b`. The 74 random bits are
drawn fresh each time, except when that would not sort after the previous id of this process (same
millisecond drawn lower, or the clock stepped back): then the previous id plus one is used (RFC
9562's "monotonic random" method), so ids of one process are strictly increasing.
"""

from __future__ import annotations

import secrets
import threading
import time
import uuid
from collections.abc import Callable

_RAND_BITS = 74
_RAND_B_BITS = 62
_RAND_MASK = (1 << _RAND_BITS) - 1


def _pack(counter: int) -> int:
    """(ms << 74 | rand) → the 128-bit UUID with version and variant bits in place."""
    ms, rand = counter >> _RAND_BITS, counter & _RAND_MASK
    rand_a, rand_b = rand >> _RAND_B_BITS, rand & ((1 << _RAND_B_BITS) - 1)
    return (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | rand_a << 64 | 0b10 << 62 | rand_b


def _unix_ms() -> int:
    return time.time_ns() // 1_000_000


class Uuid7Generator:
    """A strictly increasing UUIDv7 source; thread-safe. `clock_ms` is injectable for tests."""

    def __init__(self, clock_ms: Callable[[], int] = _unix_ms) -> None:
        self._clock_ms = clock_ms
        self._last = -1
        self._lock = threading.Lock()

    def __call__(self) -> uuid.UUID:
        candidate = self._clock_ms() << _RAND_BITS | secrets.randbits(_RAND_BITS)
        with self._lock:
            self._last = candidate if candidate > self._last else self._last + 1
            return uuid.UUID(int=_pack(self._last))


uuid7 = Uuid7Generator()


def uuid7_hex() -> str:
    """A new UUIDv7 as 32 lowercase hex digits: sorts as text in the order the ids were made."""
    return uuid7().hex

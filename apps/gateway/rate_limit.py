"""Request rates per principal at the gateway: a token bucket for each caller, refilled at `rate`
requests per second up to `burst`. A caller is its API key's principal, or, for anonymous callers,
its client address (behind a proxy every anonymous caller is the proxy: give them keys). A request
with no token left is a 429 whose `Retry-After` says when the next one fits and whose message names
the limit; it costs nothing more.

Admission (`admission.py`) bounds how many requests a caller holds at once; this bounds how fast it
may send them, which matters for the calls that hold nothing for long (token counts, stored
responses, refusals). The table of buckets stays small: a bucket full again (its caller idle for
`burst / rate` seconds) is the same as none and is forgotten, and past `max_buckets` callers the
least recently seen go first.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from apps.bus.codes import ErrorCode, ServingError

MAX_BUCKETS = 100_000
# Forgetting full buckets is checked once every this many requests.
SWEEP_EVERY = 256


class RateLimiter:
    def __init__(self, rate: float, burst: int, *, clock: Callable[[], float] = time.monotonic,
                 max_buckets: int = MAX_BUCKETS) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("a rate limit needs a positive rate and a burst of at least 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._max_buckets = max_buckets
        # caller -> (tokens left, when they were counted), least recently seen first
        self._buckets: OrderedDict[tuple[str, str], tuple[float, float]] = OrderedDict()
        self._since_sweep = 0

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, principal: str | None, address: str | None) -> None:
        """Spend one request of this caller's rate, or raise a 429 ServingError."""
        caller = ("key", principal) if principal is not None else ("address", address or "unknown")
        now = self._clock()
        tokens, then = self._buckets.pop(caller, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if tokens >= 1.0:
            self._buckets[caller] = (tokens - 1.0, now)
            self._forget_idle(now)
            return
        self._buckets[caller] = (tokens, now)
        wait_s = max(1, math.ceil((1.0 - tokens) / self.rate))
        who = "API key" if principal is not None else "client address"
        raise ServingError(
            429,
            ErrorCode.RATE_LIMIT_EXCEEDED,
            f"Rate limit exceeded: {self.rate:g} requests per second per {who}, in bursts of at most "
            f"{self.burst} (HELEXA_RATE_LIMIT_RPS, HELEXA_RATE_LIMIT_BURST); retry in {wait_s} s.",
            retry_after_s=wait_s,
            context={"detail": f"rate limit of {who}"},
        )

    def _forget_idle(self, now: float) -> None:
        while len(self._buckets) > self._max_buckets:
            self._buckets.popitem(last=False)
        self._since_sweep += 1
        if self._since_sweep < SWEEP_EVERY:
            return
        self._since_sweep = 0
        while self._buckets:
            caller, (tokens, then) = next(iter(self._buckets.items()))
            if tokens + (now - then) * self.rate < self.burst:
                return
            del self._buckets[caller]

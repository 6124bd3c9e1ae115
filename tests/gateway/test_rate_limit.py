"""Per-principal request rates (apps/gateway/rate_limit.py): a burst, then 429s whose Retry-After
says when the next request fits; other callers untouched; idle callers forgotten."""

from __future__ import annotations

import pytest

from apps.bus.codes import ErrorCode, ServingError
from apps.gateway.rate_limit import SWEEP_EVERY, RateLimiter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_burst_then_429_naming_the_limit_with_retry_after() -> None:
    clock = Clock()
    limiter = RateLimiter(2.0, 3, clock=clock)
    for _ in range(3):
        limiter.take("alice", "10.0.0.1")
    with pytest.raises(ServingError) as refused:
        limiter.take("alice", "10.0.0.1")
    exc = refused.value
    assert (exc.status, exc.code, exc.retry_after_s) == (429, ErrorCode.RATE_LIMIT_EXCEEDED, 1)
    assert "2 requests per second per API key" in exc.message and "HELEXA_RATE_LIMIT_RPS" in exc.message
    # Another principal, and an anonymous caller at the same address, have their own buckets.
    limiter.take("bob", "10.0.0.1")
    limiter.take(None, "10.0.0.1")
    clock.now += 0.5  # one request's worth at 2/s
    limiter.take("alice", "10.0.0.1")
    with pytest.raises(ServingError):
        limiter.take("alice", "10.0.0.1")


def test_retry_after_is_the_wait_for_one_request() -> None:
    clock = Clock()
    limiter = RateLimiter(0.1, 1, clock=clock)  # one request per 10 s
    limiter.take(None, "10.0.0.2")
    clock.now += 3.0
    with pytest.raises(ServingError) as refused:
        limiter.take(None, "10.0.0.2")
    assert refused.value.retry_after_s == 7
    assert "per client address" in refused.value.message
    clock.now += 7.0
    limiter.take(None, "10.0.0.2")


def test_refused_requests_do_not_dig_the_hole_deeper() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 1, clock=clock)
    limiter.take("p", None)
    for _ in range(50):
        with pytest.raises(ServingError):
            limiter.take("p", None)
    clock.now += 1.0
    limiter.take("p", None)


def test_the_table_is_capped_least_recently_seen_first() -> None:
    clock = Clock()
    limiter = RateLimiter(1.0, 2, clock=clock, max_buckets=100)
    for i in range(100):
        limiter.take(None, f"10.1.0.{i}")
    limiter.take(None, "10.1.0.0")  # its last token, and now the most recently seen
    limiter.take(None, "10.2.0.1")  # the 101st caller: 10.1.0.1, the least recently seen, goes
    assert len(limiter) == 100
    with pytest.raises(ServingError):
        limiter.take(None, "10.1.0.0")  # kept, and empty
    limiter.take(None, "10.1.0.1")
    limiter.take(None, "10.1.0.1")  # forgotten, so a full bucket again


def test_idle_callers_are_forgotten() -> None:
    clock = Clock()
    limiter = RateLimiter(10.0, 5, clock=clock)
    for i in range(100):
        limiter.take(None, f"10.1.0.{i}")
    clock.now += 1.0  # every one of those buckets is full again
    for i in range(SWEEP_EVERY):
        limiter.take(f"p{i}", None)
    assert len(limiter) == SWEEP_EVERY  # the idle hundred are gone, the ones just seen stay


def test_a_limit_needs_a_rate_and_a_burst() -> None:
    with pytest.raises(ValueError):
        RateLimiter(0.0, 1)
    with pytest.raises(ValueError):
        RateLimiter(1.0, 0)

"""The recorder's lag as metrics, and the warning before EVENTS drops events nobody recorded yet."""

from __future__ import annotations

import time

from nats.aio.client import Client as NatsClient

from apps.bus import declaration, topology
from apps.recorder.metrics import LagWatch, RecorderMetrics
from tests.recorder.conftest import LogWatch, publish, started

WARNING = "EVENTS nearing its limit with unrecorded events"


async def _unrecorded_backlog(nc: NatsClient, limits: topology.BusLimits, count: int) -> None:
    """EVENTS with `limits`, the recorders' consumer declared, and `count` events no recorder has read."""
    js = nc.jetstream()
    await declaration.ensure_topology(js, limits)
    await js.add_consumer(topology.EVENTS_STREAM, config=topology.recorder_consumer_config())
    await publish(js, *(started(f"req-{i}", node="n" * 400) for i in range(count)))


def _sample(metrics: RecorderMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    assert value is not None, name
    return value


async def test_the_lag_is_measured_in_events_and_seconds(nc: NatsClient, log_watch: LogWatch) -> None:
    published_at = time.time()
    await _unrecorded_backlog(nc, topology.BusLimits(), 12)
    metrics = RecorderMetrics()
    lag = await LagWatch(metrics).check(nc.jetstream(), now=published_at + 30)
    assert lag.unrecorded == 12
    assert 29 <= lag.oldest_unrecorded_age_s <= 31 + (time.time() - published_at)
    assert _sample(metrics, "helexa:recorder_lag_events") == 12
    assert _sample(metrics, "helexa:recorder_lag_seconds") == lag.oldest_unrecorded_age_s
    assert _sample(metrics, "helexa:events_stream_messages") == 12
    # Far from both limits (4 GiB, 7 days): no warning.
    assert not log_watch.matching(WARNING)
    assert _sample(metrics, "helexa:events_limit_warnings_total", limit="bytes") == 0


async def test_unrecorded_events_near_max_bytes_warn(nc: NatsClient, log_watch: LogWatch) -> None:
    await _unrecorded_backlog(nc, topology.BusLimits(event_max_bytes=64 << 10), 85)
    metrics = RecorderMetrics()
    lag = await LagWatch(metrics).check(nc.jetstream())
    assert lag.stream_messages == 85  # nothing dropped yet: the warning comes before the limit
    assert lag.bytes_ratio >= 0.8, lag
    (warning,) = log_watch.matching(WARNING)
    assert (warning.limit, warning.unrecorded, warning.max_bytes) == ("bytes", 85, 64 << 10)
    assert _sample(metrics, "helexa:events_limit_warnings_total", limit="bytes") == 1
    assert _sample(metrics, "helexa:events_unrecorded_limit_ratio", limit="bytes") == lag.bytes_ratio


async def test_an_unrecorded_event_near_max_age_warns_and_warnings_are_not_repeated(
    nc: NatsClient, log_watch: LogWatch
) -> None:
    await _unrecorded_backlog(nc, topology.BusLimits(event_max_age_s=1000.0), 1)
    metrics = RecorderMetrics()
    watch = LagWatch(metrics)
    assert (await watch.check(nc.jetstream(), now=time.time() + 500)).age_ratio < 0.8
    assert not log_watch.matching(WARNING)
    for _ in range(3):
        await watch.check(nc.jetstream(), now=time.time() + 900)
    # Logged once a minute at most, counted at every reading.
    assert [w.limit for w in log_watch.matching(WARNING)] == ["age"]
    assert _sample(metrics, "helexa:events_limit_warnings_total", limit="age") == 3


async def test_all_recorded_means_no_lag(nc: NatsClient) -> None:
    js = nc.jetstream()
    await _unrecorded_backlog(nc, topology.BusLimits(), 3)
    sub = await js.pull_subscribe_bind(durable=topology.RECORDER_CONSUMER, stream=topology.EVENTS_STREAM)
    for msg in await sub.fetch(3, timeout=5):
        await msg.ack_sync()
    lag = await LagWatch(RecorderMetrics()).check(js)
    assert (lag.unrecorded, lag.oldest_unrecorded_age_s) == (0, 0.0)

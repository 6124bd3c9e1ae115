"""The CPU peer benchmark's client clocks (benchmarks/openai_load.py), on hand-made timings."""

from __future__ import annotations

from benchmarks.openai_load import LoadResult, StreamTiming


def _burst() -> LoadResult:
    # Three streams called at 0, sent at 0.010/0.020/0.040, first text at 0.100/0.110/0.120.
    streams = [StreamTiming(prompt_index=i, start=0.0, sent=sent, first=first, end=0.5)
               for i, (sent, first) in enumerate([(0.010, 0.100), (0.020, 0.110), (0.040, 0.120)])]
    return LoadResult(streams, wall_s=0.5)


def test_each_clock_starts_where_it_says() -> None:
    burst = _burst()
    assert round(burst.ttft_ms_median, 3) == 110.0  # from the SDK call
    assert round(burst.ttft_from_sent_ms_median, 3) == 90.0  # 90, 90, 80 from each own body
    assert round(burst.ttft_from_last_sent_ms_median, 3) == 70.0  # 60, 70, 80 from the last body
    assert round(burst.send_spread_ms, 3) == 30.0
    assert round(burst.client_wait_ms_median, 3) == 20.0


def test_a_stream_without_a_send_time_is_timed_from_its_call() -> None:
    lone = LoadResult([StreamTiming(prompt_index=0, start=1.0, first=1.05, end=1.2)], wall_s=0.2)
    assert round(lone.ttft_from_sent_ms_median, 3) == round(lone.ttft_from_last_sent_ms_median, 3) == 50.0
    assert lone.send_spread_ms == 0.0

"""The bench's arithmetic: nearest-rank percentiles, medians, the liveness rule, rates and flatness."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from apps.bench.stats import decode_rate, flatness, flatness_verdict, is_generated, median, percentile, prefill_rate


@pytest.mark.parametrize(
    ("values", "p", "expected"),
    [
        ([1, 2, 3, 4, 5], 50, 3),
        ([1, 2, 3, 4, 5], 95, 5),  # ceil(0.95 * 5) = 5th value
        ([1, 2, 3, 4, 5], 20, 1),
        ([1, 2, 3, 4, 5], 21, 2),
        ([5, 1, 4, 2, 3], 40, 2),  # input order does not matter
        (list(range(1, 21)), 95, 19),
        (list(range(1, 101)), 99, 99),
        ([7.5], 95, 7.5),
        ([3, 1], 0, 1),  # p0 is the smallest value
        ([3, 1], 100, 3),
        ([10, 20, 30, 40], 50, 20),  # nearest rank never interpolates (would be 25)
    ],
    ids=["p50-odd", "p95-small", "p20-exact", "p21-next", "unsorted", "p95-20", "p99-100", "single", "p0",
         "p100", "no-interp"],
)
def test_percentile_is_nearest_rank(values: list[float], p: float, expected: float) -> None:
    assert percentile(values, p) == expected


def test_percentile_of_nothing_is_none_and_bad_p_is_refused() -> None:
    assert percentile([], 50) is None
    with pytest.raises(ValueError, match="0..100"):
        percentile([1.0], 101)


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False), min_size=1, max_size=50),
       st.floats(min_value=0, max_value=100))
def test_percentile_is_a_value_with_at_least_p_percent_at_or_below(values: list[float], p: float) -> None:
    result = percentile(values, p)
    assert result in values
    at_or_below = sum(1 for v in values if v <= result)
    assert at_or_below >= p / 100 * len(values) - 1e-9
    # and it is the smallest such value
    below = sum(1 for v in values if v < result)
    assert below < max(math.ceil(p / 100 * len(values)), 1)


@pytest.mark.parametrize(
    ("values", "expected"),
    [([3, 1, 2], 2), ([4, 1, 3, 2], 2.5), ([9], 9), ([], None), ([1, 1, 100], 1)],
    ids=["odd", "even-mean-of-middle", "single", "empty", "robust-to-outlier"],
)
def test_median(values: list[float], expected: float | None) -> None:
    assert median(values) == expected


@pytest.mark.parametrize(
    ("ratio", "verdict"),
    [(1.02, "holds"), (0.9, "holds"), (0.8999, "softens"), (0.7, "softens"), (0.6999, "drops"), (0.1, "drops"),
     (None, None)],
)
def test_flatness_verdicts_at_their_boundaries(ratio: float | None, verdict: str | None) -> None:
    assert flatness_verdict(ratio) == verdict


def test_flatness_is_largest_over_smallest_context() -> None:
    assert flatness(50.0, 45.0) == pytest.approx(0.9)
    assert flatness_verdict(flatness(50.0, 30.0)) == "drops"
    assert flatness(None, 10.0) is None
    assert flatness(0.0, 10.0) is None


@pytest.mark.parametrize(
    ("delta", "generated"),
    [
        ({"content": "Hi"}, True),
        ({"reasoning_content": "Let me think"}, True),  # a thinking model's first output
        ({"content": "", "reasoning_content": "hmm"}, True),
        ({"role": "assistant", "content": ""}, False),  # the opening role chunk
        ({"content": None, "reasoning_content": None}, False),
        ({"tool_calls": [{"index": 0}]}, False),
        ({}, False),
    ],
    ids=["content", "reasoning-only", "empty-content-with-reasoning", "role-chunk", "nulls", "tool-call", "empty"],
)
def test_liveness_counts_content_or_reasoning(delta: dict, generated: bool) -> None:
    assert is_generated(delta) is generated


def test_decode_rate_prefers_the_servers_timing() -> None:
    # 11 tokens: the first ends prefill, 10 decoded in 500 ms -> 20 tok/s, whatever the client saw.
    assert decode_rate(11, 500.0, 3, 0.1, 0.2) == (20.0, "server")
    # No server timing: chunks over the client's window between first and last generated chunk.
    assert decode_rate(11, None, 5, 1.0, 3.0) == (2.0, "client")
    # Reasoning tokens the server counted are never divided by a visible-only window.
    assert decode_rate(500, None, 5, 1.0, 3.0) == (2.0, "client")
    assert decode_rate(1, None, 1, 1.0, 1.0) == (None, None)


def test_prefill_rate_prefers_the_servers_timing() -> None:
    assert prefill_rate(200, 100.0, 256, 0.5) == (2000.0, "server")
    assert prefill_rate(None, None, 256, 0.5) == (512.0, "client")
    assert prefill_rate(None, None, None, 0.5) == (None, None)

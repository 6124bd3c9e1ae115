"""An idle engine gathers a burst of requests before its first step (engine.core.batch_window), and the
scheduler says when the waiting requests alone would fill a step."""

from __future__ import annotations

import pytest

from apps.settings import WorkerSettings
from engine.core.batch_window import ARRIVAL_GAP_S, UNANNOUNCED_GAP_S, gather_burst
from engine.frontend.engine_config import EngineConfig
from tests.engine.test_scheduler import make_request, make_scheduler


class Arrivals:
    """A pipe on a scripted clock: requests arrive at the given times (seconds), each announcing
    more behind it (`more_arriving`) unless its time is in `unannounced`."""

    def __init__(self, times: list[float], unannounced: tuple[float, ...] = ()) -> None:
        self.pending, self.now, self.taken = sorted(times), 0.0, 0
        self.unannounced = unannounced
        self.more_arriving = True  # the request that opened the window announced its burst

    def clock(self) -> float:
        return self.now

    def poll(self, timeout: float) -> bool:
        if self.pending and self.pending[0] <= self.now + timeout:
            self.now = max(self.now, self.pending[0])
            return True
        self.now += timeout
        return False

    def take(self) -> bool:
        self.more_arriving = self.pending.pop(0) not in self.unannounced
        self.taken += 1
        return True


def gather(arrivals: Arrivals, window_s: float, full_after: int | None = None) -> bool:
    return gather_burst(arrivals.poll, arrivals.take,
                        lambda: full_after is not None and arrivals.taken >= full_after,
                        lambda: arrivals.more_arriving, window_s, arrivals.clock)


def test_requests_that_keep_coming_are_gathered_until_a_gap() -> None:
    gap = ARRIVAL_GAP_S
    arrivals = Arrivals([0.2 * gap, 0.9 * gap, 1.5 * gap, 1.5 * gap + 1.01 * gap, 10 * gap])
    assert gather(arrivals, window_s=100 * gap)
    assert arrivals.taken == 3  # the fourth came more than a gap after the third
    assert arrivals.now == pytest.approx(2.5 * gap)  # one gap of waiting after the last arrival


def test_the_window_bounds_the_whole_wait() -> None:
    gap = ARRIVAL_GAP_S
    arrivals = Arrivals([i * 0.5 * gap for i in range(1, 40)])
    assert gather(arrivals, window_s=4 * gap)
    assert arrivals.taken == 8 and arrivals.now == pytest.approx(4 * gap)


def test_a_full_step_stops_the_wait_at_once() -> None:
    arrivals = Arrivals([0.0001] * 10)
    assert gather(arrivals, window_s=1.0, full_after=4)
    assert arrivals.taken == 4 and arrivals.now == pytest.approx(0.0001)


def test_a_request_that_announced_others_waits_one_long_gap_for_them() -> None:
    arrivals = Arrivals([])
    assert gather(arrivals, window_s=1.0)
    assert arrivals.now == pytest.approx(ARRIVAL_GAP_S)


def test_a_lone_request_waits_only_the_short_gap() -> None:
    arrivals = Arrivals([])
    arrivals.more_arriving = False
    assert gather(arrivals, window_s=1.0)
    assert arrivals.now == pytest.approx(UNANNOUNCED_GAP_S)


def test_the_last_of_an_announced_burst_ends_the_wait_a_short_gap_after_it() -> None:
    gap = ARRIVAL_GAP_S
    # The third request is the last its gateway was reading; a fourth comes a long gap later.
    arrivals = Arrivals([0.5 * gap, 1.0 * gap, 1.5 * gap + UNANNOUNCED_GAP_S], unannounced=(1.0 * gap,))
    assert gather(arrivals, window_s=100 * gap)
    assert arrivals.taken == 2
    assert arrivals.now == pytest.approx(1.0 * gap + UNANNOUNCED_GAP_S)


def test_a_shutdown_taken_during_the_wait_is_reported() -> None:
    arrivals = Arrivals([0.0001])
    assert not gather_burst(arrivals.poll, lambda: False, lambda: False, lambda: True, 1.0, arrivals.clock)


def test_a_step_is_full_by_its_token_budget_or_its_seats() -> None:
    by_tokens = make_scheduler(max_num_batched_tokens=100)
    by_tokens.add_request(make_request("a", 60))
    assert not by_tokens.next_step_is_full()
    by_tokens.add_request(make_request("b", 40, first_token=2000))
    assert by_tokens.next_step_is_full()
    by_seats = make_scheduler(max_num_seqs=2)
    by_seats.add_request(make_request("a", 3))
    assert not by_seats.next_step_is_full()
    by_seats.add_request(make_request("b", 3, first_token=2000))
    assert by_seats.next_step_is_full()


def test_helexa_batch_window_ms_reaches_the_engine_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert WorkerSettings().engine_config("m.gguf").batch_window_ms == 30.0
    monkeypatch.setenv("HELEXA_BATCH_WINDOW_MS", "0")
    assert WorkerSettings().engine_config("m.gguf").batch_window_ms == 0.0
    monkeypatch.setenv("HELEXA_BATCH_WINDOW_MS", "5000")
    with pytest.raises(ValueError, match="HELEXA_BATCH_WINDOW_MS"):
        WorkerSettings()
    with pytest.raises(ValueError, match="batch_window_ms"):
        EngineConfig(model="m", batch_window_ms=-1)

"""The services' CPU benchmark's marginal figure: what a role spends idle over the load's wall time
is taken out, so a slower load with the same work per request shows the same marginal cost."""

from __future__ import annotations

from benchmarks.services_cpu import marginal


def test_idle_cpu_over_the_loads_wall_time_is_taken_out() -> None:
    idle = {"nats": 20.0, "gateway": 10.0}  # ms over a 10 s idle window: 2 and 1 ms per second
    fast = marginal({"nats": 180.0, "gateway": 330.0}, idle, idle_wall_s=10.0, wall_s=40.0, requests=16)
    slow = marginal({"nats": 340.0, "gateway": 410.0}, idle, idle_wall_s=10.0, wall_s=120.0, requests=16)
    assert fast == slow == {"gateway": 18.125, "nats": 6.25}


def test_a_role_with_no_idle_window_keeps_its_whole_cost() -> None:
    assert marginal({"client": 32.0}, {}, idle_wall_s=5.0, wall_s=3.0, requests=16) == {"client": 2.0}

"""The simulated fleet's pure parts (benchmarks/fleet_sim.py): its arguments, one run's arithmetic,
the host-bound label and the medians over runs. The fleet itself runs only as the benchmark."""

from __future__ import annotations

import pytest

from benchmarks.fleet_sim import (
    DEFAULT_POINTS,
    Point,
    busy_share,
    ceilings,
    fleet_role,
    host_bound,
    medians,
    parse_args,
    run_figures,
    script,
)


def test_points_parse_as_gateways_workers_streams() -> None:
    args = parse_args(["--points", "1,2,8", "4,16,256", "--runs", "2"])
    assert args.points == [Point(1, 2, 8), Point(4, 16, 256)]
    assert args.runs == 2
    assert parse_args([]).points == [Point.parse(p) for p in DEFAULT_POINTS]


@pytest.mark.parametrize("bad", ["1,2", "a,b,c", "0,1,1", "1,1,-3"], ids=["two", "words", "zero", "negative"])
def test_a_malformed_point_is_refused(bad: str) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--points", bad])


def test_non_positive_rates_are_refused() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--token-rate", "0"])


def test_one_runs_figures() -> None:
    # 2,000 tokens in 2 s on 2 cores; 1,500 ms of CPU in all is 37.5 % of the host.
    figures = run_figures(tokens=2000, wall_s=2.0, cpu_ms={"gateway": 600.0, "worker": 400.0, "nats": 200.0,
                                                            "client": 300.0},
                          messages=5000, cpus=2, host_busy_share=0.5, ttfts_s=[0.06, 0.07, 0.08],
                          gaps_s=[0.021, 0.022, 0.030], ttft_script_s=0.05, token_delay_s=0.02)
    assert figures["tokens_per_s"] == 1000
    assert figures["nats_messages_per_s"] == 2500
    assert figures["nats_messages_per_token"] == 2.5
    assert figures["cpu_ms_per_1k_tokens"] == {"gateway": 300.0, "worker": 200.0, "recorder": 0.0, "nats": 100.0,
                                               "postgres": 0.0, "client": 150.0}
    assert figures["fleet_cpu_share"] == 0.375
    assert figures["host_bound"] is False
    assert figures["ttft_added_ms_p50"] == pytest.approx(20.0)
    assert figures["itl_added_ms_p50"] == pytest.approx(2.0)
    assert figures["itl_added_ms_p99"] == pytest.approx(10.0)


def test_a_point_over_ninety_percent_of_the_cores_is_host_bound() -> None:
    assert host_bound(cpu_ms_total=3700.0, wall_s=2.0, cpus=2, host_busy_share=0.5)
    assert not host_bound(cpu_ms_total=3500.0, wall_s=2.0, cpus=2, host_busy_share=0.5)


def test_a_host_kept_busy_by_others_makes_the_point_host_bound() -> None:
    assert host_bound(cpu_ms_total=1000.0, wall_s=2.0, cpus=2, host_busy_share=0.95)


def test_busy_share_counts_idle_and_iowait_as_not_busy() -> None:
    from collections import namedtuple

    Times = namedtuple("Times", "user system idle iowait")
    assert busy_share(Times(0, 0, 0, 0), Times(30.0, 10.0, 50.0, 10.0)) == 0.4


def test_a_kinds_ceiling_is_one_core_over_its_cost() -> None:
    assert ceilings({"gateway": 250.0, "recorder": 0.0}) == {"gateway": 4000, "recorder": None}


def test_medians_over_runs_and_host_bound_if_any_run_was() -> None:
    runs = [{"tokens_per_s": v, "host_bound": v > 25, "cpu_ms_per_1k_tokens": {"gateway": v * 10}}
            for v in (10.0, 30.0, 20.0)]
    assert medians(runs) == {"runs": 3, "tokens_per_s": 20.0, "host_bound": True,
                             "cpu_ms_per_1k_tokens": {"gateway": 200.0},
                             "ceiling_tokens_per_s_per_core": {"gateway": 5000}}


def test_fleet_processes_are_told_apart_by_command_line() -> None:
    python = "/venv/bin/python"
    worker = [python, "-m", "apps.cli", "worker", "--script", "s.json", "--served-model-name", "f"]
    assert fleet_role(worker) == "worker"
    assert fleet_role([python, "-m", "apps.cli", "gateway"]) == "gateway"
    assert fleet_role(["/bin/nats-server", "-c", "x.conf"]) == "nats"
    assert fleet_role(["postgres: helexa_recorder postgres 127.0.0.1"]) == "postgres"


def test_the_script_paces_every_rule() -> None:
    found = script(tokens=4, ttft_s=0.05, token_delay_s=0.02)
    assert found["rules"][0]["first_token_delay_s"] == 0.05
    assert found["rules"][0]["token_delay_s"] == 0.02
    assert len(found["default"].split()) == 12

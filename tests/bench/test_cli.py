"""`helexa bench` refuses what it cannot do with a clear message and a non-zero exit, before any request."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from apps.embedded import free_port
from tests.support import BENCH_AGAINST_NOTHING, REPO


def helexa(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], cwd=REPO, env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)


def test_an_unreachable_nats_stops_the_run_before_it_starts(tmp_path: Path) -> None:
    config = tmp_path / "bench.toml"
    config.write_text(BENCH_AGAINST_NOTHING.format(port=free_port()), encoding="utf-8")
    ran = helexa("bench", "run", str(config), NATS_URL=f"nats://127.0.0.1:{free_port()}")
    assert ran.returncode == 1
    assert "cannot publish to NATS" in ran.stderr and "--no-publish" in ran.stderr
    assert "run " not in ran.stderr  # no scenario ran


def test_no_publish_needs_somewhere_to_write(tmp_path: Path) -> None:
    config = tmp_path / "bench.toml"
    config.write_text(BENCH_AGAINST_NOTHING.format(port=free_port()), encoding="utf-8")
    ran = helexa("bench", "run", str(config), "--no-publish")
    assert ran.returncode == 1
    assert "--no-publish needs --out" in ran.stderr


def test_a_missing_results_file_is_a_clear_error(tmp_path: Path) -> None:
    ran = helexa("bench", "report", "--results", str(tmp_path / "missing.json"))
    assert ran.returncode == 1
    assert "cannot read bench runs" in ran.stderr


def test_a_target_that_refuses_connections_is_recorded_as_a_failed_run(tmp_path: Path) -> None:
    from apps.bench.publish import ResultsFile

    config = tmp_path / "bench.toml"
    config.write_text(BENCH_AGAINST_NOTHING.format(port=free_port()), encoding="utf-8")
    out = tmp_path / "results.json"
    ran = helexa("bench", "run", str(config), "--no-publish", "--out", str(out))
    assert ran.returncode == 1
    (run,) = ResultsFile.read(out).runs
    assert (run.target, run.model, run.scenario) == ("t", "m", "chat:8")
    assert "ConnectError" in run.results["error"]
    assert ResultsFile.read(out).scores == []

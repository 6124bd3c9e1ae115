"""benchmarks/cpu_quota.py end to end at a tiny size: torch's count and the fitted count (the
governed mode is thread_governor's, tested there) run in a real cgroup with a CPU quota, every run's
tokens equal, the fitted mode starting on the threads the quota allows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.lib import cpu_quota_cgroup

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_runs_each_mode_under_the_quota(tmp_path: Path) -> None:
    with cpu_quota_cgroup(1.0) as directory:
        if directory is None:
            pytest.skip("this machine lets no one make a cgroup with a CPU quota (needs root and cgroup v1's cpu)")
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "benchmarks.cpu_quota", "--new", "4", "--runs", "1",
                    "--modes", "torch,fitted", "--out", str(out)],
                   cwd=ROOT, check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["inputs"]["quota_cpus"] == 1.0 and report["inputs"]["new_tokens"] == 4
    results = report["results"]
    assert "governed" not in results
    for mode in ("torch", "fitted"):
        assert results[mode]["correct"] is True and results[mode]["seconds_median"] > 0
    cores = len(os.sched_getaffinity(0))
    assert results["torch"]["threads_at_start"] == results["torch"]["torch_threads"]
    assert results["fitted"]["threads_at_start"] == 1 <= cores
    assert results["fitted_vs_torch"] > 0

"""benchmarks/thread_governor.py end to end at a tiny size, beside a spinning process (the quiet
condition is the same measurement without it): both modes measured, every run's tokens equal, the
ratio printed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_benchmark_measures_both_modes_beside_a_busy_process(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    subprocess.run([sys.executable, "-m", "benchmarks.thread_governor", "--new", "4", "--runs", "1",
                    "--conditions", "busy", "--out", str(out)], cwd=ROOT, check=True, capture_output=True, timeout=600)
    report = json.loads(out.read_text())
    assert report["inputs"]["new_tokens"] == 4 and report["machine"]["cpus"] >= 1
    assert list(report["results"]) == ["busy"]
    for condition in ("busy",):
        level = report["results"][condition]
        for mode in ("governed", "fixed"):
            assert level[mode]["correct"] is True
            assert level[mode]["seconds_median"] > 0 and level[mode]["moves_runs"] == [[]]
        assert level["governed_vs_fixed"] > 0

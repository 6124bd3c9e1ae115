"""`helexa bench`'s `swap` scenario against helexa workers: the model is unloaded and loaded again
through model control, and the cold first request after the reload is timed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from apps.bench.publish import ResultsFile
from tests.fleet.conftest import COLD_MODEL, Fleet
from tests.fleet.test_service import ask, helexa
from tests.support import REPO


def test_swap_unloads_reloads_and_times_the_cold_request(fleet: Fleet, tmp_path: Path) -> None:
    config = tmp_path / "swap.toml"
    config.write_text(f"""
models = ["{COLD_MODEL}"]
scenarios = ["swap"]
samples = 1
max_tokens = 4
timeout_s = 60
swap_timeout_s = 60

[[targets]]
name = "fleet"
base_url = "{fleet.base_url}/v1"
nats_url = "{fleet.nats_url}"
""", encoding="utf-8")
    with fleet.worker("swap-a", "swap-warm", {"default": "back again"}, HELEXA_WORKER_MEMORY_MB="1000"):
        assert ask(fleet, COLD_MODEL, "warm up") == "back again"  # loaded from the catalogue
        out = tmp_path / "results.json"
        ran = subprocess.run([sys.executable, "-m", "apps.cli", "bench", "run", str(config), "--no-publish",
                              "--out", str(out)], cwd=REPO, env={**os.environ, **fleet.env_for("bench")},
                             capture_output=True, text=True, timeout=300)
        assert ran.returncode == 0, ran.stdout + ran.stderr
        run, = ResultsFile.read(out).runs
        assert run.scenario == "swap" and "error" not in run.results, run.results
        assert run.results["unload_ms"] > 0 and run.results["load_ms"] > 0
        assert run.results["cold"]["completion_tokens"] > 0
        # The model is served again after the swap, by the same node.
        assert COLD_MODEL in helexa(fleet, "models", "ls")["models"]
        assert ask(fleet, COLD_MODEL, "still there?") == "back again"

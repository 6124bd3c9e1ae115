"""An app started while no NATS server answers says so in one line (no traceback per attempt, as
nats-py's own error callback logs twice a second) and stops on SIGTERM while still waiting."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from apps.embedded import free_port
from tests.support import AppProcess


@pytest.mark.parametrize("app", ["gateway", "worker", "recorder"])
def test_an_app_waiting_for_nats_says_so_once_and_stops_on_sigterm(app: str, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps({"default": "Paris."}), encoding="utf-8")
    nowhere = free_port()  # nothing listens there
    process = AppProcess([app], {"NATS_URL": f"nats://127.0.0.1:{nowhere}",
                                 "DATABASE_URL": f"postgresql://nobody:secret@127.0.0.1:{free_port()}/none",
                                 "HELEXA_PORT": str(free_port()), "HELEXA_WORKER_SCRIPT": str(script)})
    try:
        process.wait_for(lambda e: e.get("event") == "cannot reach NATS, retrying", timeout_s=120)
        returncode = process.stop(timeout_s=15)  # past that it is killed: returncode -9
        output = process.output()
        assert returncode == 0, output
        assert "Traceback" not in output
        assert sum(e.get("event") == "cannot reach NATS, retrying" for e in process.lines) == 1, output
        assert "secret" not in output
    finally:
        process.kill()

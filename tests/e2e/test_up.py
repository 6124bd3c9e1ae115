"""`helexa up` serves, then stops cleanly: no nats-server or postgres left after SIGTERM."""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import httpx
import psutil

from apps.embedded import free_port
from tests.support import AppProcess


def processes_using(folder: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["name", "cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(folder) in cmdline:
            found.append(proc)
    return found


def test_up_serves_and_stops_cleanly() -> None:
    data = Path(tempfile.mkdtemp(prefix="helexa-up-")) / "data"
    port = free_port()
    up = AppProcess(["up", "--data-dir", str(data), "--port", str(port)], {"NATS_URL": "", "DATABASE_URL": ""})
    try:
        ready = up.wait_for(lambda e: e.get("event") == "ready" and e.get("app") == "up", timeout_s=300)
        assert ready["url"] == f"http://127.0.0.1:{port}"
        servers = processes_using(data)
        names = {p.info["name"] for p in servers}
        assert "nats-server" in names and "postgres" in names, names
        models = httpx.get(f"{ready['url']}/v1/models", timeout=30).json()
        assert [m["id"] for m in models["data"]] == [ready["model"]]

        assert up.stop(signal.SIGTERM, timeout_s=90) == 0
        assert not [p for p in servers if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert processes_using(data) == []
    finally:
        up.kill()
        shutil.rmtree(data.parent, ignore_errors=True)

"""A gateway told to stop (SIGTERM, what `helexa up` and a fleet's supervisor send) takes no new
request, gives the answers in flight its stop grace, then ends each with a `gateway_stopping`
error and `[DONE]`: the signal is the app's, not the HTTP server's, so a stream is never cut
without a word."""

from __future__ import annotations

import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from apps.embedded import free_port
from tests.e2e.conftest import System, scripted_worker
from tests.support import AppProcess

MODEL = "stop-slow"
# Far longer than the stop grace: 200 tokens half a second apart.
SCRIPT = {"rules": [{"match": "", "reply": " ".join(f"w{i}" for i in range(200)), "token_delay_s": 0.5}]}


@pytest.fixture(scope="module")
def slow_model(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scripted_worker(system, tmp_path_factory.mktemp("script"), MODEL, SCRIPT) as worker:
        yield MODEL
        assert worker.process.poll() is None, "the worker died"


def test_a_stopping_gateway_ends_its_streams_with_an_error_after_the_grace(system: System, slow_model: str,
                                                                        tmp_path: Path) -> None:
    port = free_port()
    gateway = AppProcess(["gateway"], {"NATS_URL": system.nats_url, "DATABASE_URL": system.database_url,
                                       "HELEXA_PORT": str(port), "HELEXA_STOP_GRACE_S": "1"})
    try:
        gateway.wait_ready()
        streaming = threading.Event()
        lines: list[str] = []
        body = {"model": slow_model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 200,
                "temperature": 0, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[len("data: "):])
                    if not streaming.is_set() and '"content"' in line:
                        streaming.set()
                        gateway.process.send_signal(signal.SIGTERM)
        assert streaming.is_set(), lines
        assert lines[-1] == "[DONE]", lines[-3:]
        error = json.loads(lines[-2])["error"]
        assert error["code"] == "gateway_stopping", error
        assert gateway.process.wait(timeout=60) == 0, gateway.output()
        assert "Traceback" not in gateway.output()
    finally:
        gateway.stop()

"""A client that hangs up mid-stream stops its generation; the ledger says it was cancelled."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from apps.embedded import free_port
from tests.e2e.conftest import System
from tests.e2e.test_chat import finished_run
from tests.support import AppProcess, eventually

LONG = 2000


def stream_until_first_text(base_url: str, model: str, on_first_text: Callable[[], None] = lambda: None) -> str:
    """Start a long stream, read until its first text arrives, call `on_first_text`, then hang up;
    returns the request id."""
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count from one to a thousand."}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    request_id = None
    with httpx.Client(base_url=base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    request_id = chunk["id"]
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        on_first_text()
                        break
        # Leaving the block closes the connection mid-stream.
    assert request_id is not None
    return request_id


def test_disconnect_mid_stream_aborts_the_generation(system: System) -> None:
    request_id = stream_until_first_text(system.base_url, system.model)
    row = asyncio.run(finished_run(system, request_id))
    assert row["status"] == "cancelled"
    assert row["finish_reason"] == "abort"
    assert 0 < row["completion_tokens"] < LONG
    assert_engine_idle(system)


def engine_state(system: System) -> dict[str, float]:
    text = httpx.get(f"{system.base_url}/metrics", timeout=30).text
    wanted = {"helexa:num_requests_running", "helexa:kv_cache_usage_perc"}
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted and s.labels.get("model") == system.model}


def assert_engine_idle(system: System, timeout_s: float = 20.0) -> None:
    """The worker's next status refresh shows no running sequence and every KV block free."""
    idle = {"helexa:num_requests_running": 0, "helexa:kv_cache_usage_perc": 0}
    eventually(lambda: engine_state(system) == idle, timeout_s, message=lambda: repr(engine_state(system)))


def test_a_gateway_killed_mid_stream_leaves_no_generation_running(system: System) -> None:
    port = free_port()
    gateway = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port)})
    try:
        gateway.wait_ready()
        # SIGKILL once text flows: the dead gateway never sends a cancel message.
        request_id = stream_until_first_text(f"http://127.0.0.1:{port}", system.model, gateway.kill)
        # The worker notices nobody answers its liveness probe any more and aborts.
        row = asyncio.run(finished_run(system, request_id))
        assert row["status"] == "cancelled" and row["finish_reason"] == "abort"
        assert 0 < row["completion_tokens"] < LONG
        assert_engine_idle(system)
    finally:
        gateway.kill()

"""An engine core that dies restarts (issue 35): a worker of its own serves the default model under
another name; its core process is SIGKILLed while a stream runs on it. The stream goes on elsewhere
(the `engine_lost` error frame migrates it, here to the same worker's new core) and finishes with
its full token count; the worker serves a new request without a reload; the ledger has the
`engine.restart` event. A stream on the session's own worker runs through all of it untouched.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Iterator

import asyncpg
import httpx
import psutil
import pytest

from tests.e2e.conftest import STATUS_INTERVAL_S, System
from tests.support import AppProcess, eventually_async
from tests.system import read_chat_stream

MODEL = "restart-e2e"
TOKENS = 120


def body(model: str, stream: bool, max_tokens: int = TOKENS) -> dict:
    return {"model": model, "stream": stream, "stream_options": {"include_usage": True} if stream else None,
            "messages": [{"role": "user", "content": "Tell me everything you know about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def worker(system: System) -> Iterator[AppProcess]:
    process = AppProcess(["worker", "--served-model-name", MODEL],
                         {"NATS_URL": system.nats_url, "HELEXA_NODE_ID": "e2e-restart",
                          "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S)})
    try:
        process.wait_ready(300)
        yield process
    finally:
        process.stop()


def stream(system: System, model: str, first_text: threading.Event, out: dict) -> None:
    """One streamed chat completion; what it said, how it ended, its usage and any error event."""
    with httpx.Client(base_url=system.base_url, timeout=600) as http:
        with http.stream("POST", "/v1/chat/completions", json=body(model, True)) as response:
            out["status"] = response.status_code
            out.update(read_chat_stream(response, first_text))


def core_pid(worker: AppProcess) -> int:
    """The engine core process the worker runs now (the latest one it started)."""
    lines = [e for e in worker.lines if e.get("event") in ("engine core started", "engine core restarted")]
    return int(lines[-1]["pid"])


async def restart_events(database_url: str) -> list[dict]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT payload FROM events WHERE kind = 'engine.restart' AND node = 'e2e-restart'")
        return [json.loads(r["payload"]) if isinstance(r["payload"], str) else dict(r["payload"]) for r in rows]
    finally:
        await conn.close()


def test_a_killed_core_restarts_and_its_stream_goes_on(system: System, worker: AppProcess) -> None:
    old_pid = core_pid(worker)
    assert psutil.Process(old_pid).ppid() == worker.process.pid

    victim_text, victim = threading.Event(), {}
    bystander_text, bystander = threading.Event(), {}
    threads = [threading.Thread(target=stream, args=(system, MODEL, victim_text, victim)),
               threading.Thread(target=stream, args=(system, system.model, bystander_text, bystander))]
    for thread in threads:
        thread.start()
    try:
        assert victim_text.wait(300), f"the stream never produced text: {victim}"
        os.kill(old_pid, signal.SIGKILL)
    finally:
        for thread in threads:
            thread.join(600)

    # The killed core's stream went on from a new core: one whole answer, no error.
    assert victim["status"] == 200 and victim["errors"] == [], victim
    assert victim["finish"] == "length" and victim["usage"]["completion_tokens"] == TOKENS, victim
    # The stream on the other worker never noticed.
    assert bystander["errors"] == [] and bystander["usage"]["completion_tokens"] == TOKENS, bystander

    new_pid = core_pid(worker)
    assert new_pid != old_pid and not psutil.pid_exists(old_pid)  # reaped by the worker
    assert psutil.Process(new_pid).ppid() == worker.process.pid
    with httpx.Client(base_url=system.base_url, timeout=300) as http:
        again = http.post("/v1/chat/completions", json=body(MODEL, False, max_tokens=8))
        assert again.status_code == 200, again.text
        assert again.json()["usage"]["completion_tokens"] == 8
        models = http.get("/v1/models").json()["data"]
        assert any(m["id"] == MODEL for m in models)

    events = asyncio.run(eventually_async(lambda: restart_events(system.database_url), 30,
                                          message=lambda: system.recorder.output()))
    assert len(events) == 1, events
    event = events[0]
    assert event["restarted"] is True and event["model"] == MODEL and event["exitcode"] == -signal.SIGKILL
    assert event["held_requests"] == 1 and event["restarts"] == 1 and event["max_restarts"] == 3

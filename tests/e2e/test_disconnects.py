"""Clients that leave end their generations, on every endpoint and in every phase.

A scripted worker's delays make each phase last long enough to be hit: queued for admission,
published and waiting for `Accepted`, generating a non-streamed answer, streaming. Whatever the
phase, the admission counters return to zero and the worker stops generating; and a real
model's KV cache is free again within 2 s of a non-streamed client leaving.
"""

from __future__ import annotations

import asyncio
import json
import random
import socket
from collections.abc import Iterator

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps.embedded import free_port
from tests.e2e.conftest import STATUS_INTERVAL_S, System, scripted_worker
from tests.support import AppProcess, eventually

SLOW = "disconnect-slow"
REPLY = " ".join(f"w{i}" for i in range(80))
PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages")


@pytest.fixture(scope="module")
def slow_model(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # About 0.3 s to the first token, then 80 tokens 20 ms apart.
    script = {"rules": [{"match": "", "reply": REPLY, "first_token_delay_s": 0.3, "token_delay_s": 0.02}]}
    with scripted_worker(system, tmp_path_factory.mktemp("script"), SLOW, script) as worker:
        yield SLOW
        assert worker.process.poll() is None, "the worker died"


def gauges(url: str, model: str) -> dict[str, float]:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    wanted = {"helexa:admission_pending", "helexa:admission_in_flight", "helexa:num_requests_running",
              "helexa:kv_cache_usage_perc"}
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name in wanted and s.labels.get("model") == model}


def body_for(path: str, model: str, stream: bool, max_tokens: int = 80) -> dict:
    if path == "/v1/completions":
        return {"model": model, "prompt": "Go on.", "max_tokens": max_tokens, "stream": stream}
    return {"model": model, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": max_tokens,
            "stream": stream}


def request_bytes(path: str, body: dict, port: int) -> bytes:
    data = json.dumps(body).encode()
    # The Host a keyless loopback gateway answers (any other is a 421).
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode() + data


async def leave_at_random(port: int, rng: random.Random, model: str) -> str:
    """One request that hangs up at a random point; returns the phase it aimed for."""
    path, stream = rng.choice(PATHS), rng.random() < 0.5
    phase = rng.choice(["queued", "waiting", "started" if stream else "generating"])
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request_bytes(path, body_for(path, model, stream), port))
        await writer.drain()
        if phase == "queued":
            await asyncio.sleep(rng.uniform(0.0, 0.2))
        elif phase == "waiting":
            await asyncio.sleep(rng.uniform(0.1, 0.4))  # inside the first-token delay
        elif phase == "generating":
            await asyncio.sleep(rng.uniform(0.4, 1.5))
        else:
            # Streamed: the worker has answered once the headers come, then read a little.
            await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
            await asyncio.wait_for(reader.read(rng.randrange(1, 2000)), 60)
    except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
        pass  # refused or answered early: leaving now is just as good
    finally:
        writer.transport.abort()
    return phase


def test_admission_returns_to_zero_after_200_random_hang_ups(system: System, slow_model: str) -> None:
    port = free_port()
    gateway = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port),
                                       "HELEXA_MAX_IN_FLIGHT": "4", "HELEXA_MAX_QUEUE_DEPTH": "12",
                                       "HELEXA_MAX_WAIT_S": "30"})
    url = f"http://127.0.0.1:{port}"
    try:
        gateway.wait_ready()
        eventually(lambda: httpx.get(f"{url}/ready").status_code == 200, 30)
        rng = random.Random(13)

        async def waves() -> list[str]:
            phases: list[str] = []
            for _ in range(10):
                phases += await asyncio.gather(*(leave_at_random(port, rng, slow_model) for _ in range(20)))
            return phases

        phases = asyncio.run(waves())
        assert len(phases) == 200 and set(phases) == {"queued", "waiting", "started", "generating"}
        idle = {"helexa:admission_pending": 0, "helexa:admission_in_flight": 0, "helexa:num_requests_running": 0}
        eventually(lambda: {k: v for k, v in gauges(url, slow_model).items() if k in idle} == idle, 30,
                   message=lambda: repr(gauges(url, slow_model)))
        # Nothing was stranded: the model still admits (and answers) a request of each API.
        with httpx.Client(base_url=url, timeout=60) as http:
            for path in PATHS:
                assert http.post(path, json=body_for(path, slow_model, False, 4)).status_code == 200
    finally:
        gateway.stop()


def test_a_non_streamed_client_that_leaves_frees_its_kv_within_2_s(system: System) -> None:
    """On the real model: the KV cache the request holds is free again within 2 s of the hang-up
    (as the worker's own stats in the node registry say: up to a status interval later, plus one
    interval of slack for the watch that carries them)."""
    body = {**body_for("/v1/chat/completions", system.model, False, 2000), "ignore_eos": True, "temperature": 0}
    host, port = system.base_url.removeprefix("http://").split(":")
    conn = socket.create_connection((host, int(port)))
    try:
        conn.sendall(request_bytes("/v1/chat/completions", body, int(port)))
        eventually(lambda: (g := gauges(system.base_url, system.model))["helexa:num_requests_running"] >= 1
                   and g["helexa:kv_cache_usage_perc"] > 0, 60, message="the request never ran")
    finally:
        conn.close()
    idle = {"helexa:num_requests_running": 0, "helexa:kv_cache_usage_perc": 0}
    eventually(lambda: {k: v for k, v in gauges(system.base_url, system.model).items() if k in idle} == idle,
               2.0 + 2 * STATUS_INTERVAL_S, interval_s=0.1,
               message=lambda: f"KV still held: {gauges(system.base_url, system.model)}")

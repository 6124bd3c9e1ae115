"""Admission through real gateways: the overload mix, the per-principal cap, the wait deadline,
queued waiters that hang up, and every decision in the ledger.

The generations run on a scripted worker whose delays say how long each one holds its slot, so
what is queued, running or finished when does not depend on how fast the machine is."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps.embedded import free_port
from tests.e2e.conftest import System, scripted_worker
from tests.support import AppProcess, eventually, eventually_async

SLOW = "admission-slow"
WORDS = " ".join(f"w{i}" for i in range(600))
# "hold" requests keep their slot about 1 s per 20 tokens; "quick" ones answer at once.
SCRIPT = {"rules": [{"match": "hold", "reply": WORDS, "first_token_delay_s": 1.0, "token_delay_s": 0.05},
                    {"match": "quick", "reply": WORDS}],
          "default": WORDS}


@pytest.fixture(scope="module")
def slow_model(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with scripted_worker(system, tmp_path_factory.mktemp("script"), SLOW, SCRIPT):
        yield SLOW


@contextmanager
def gateway(system: System, **env: str) -> Iterator[str]:
    port = free_port()
    process = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port), **env})
    try:
        process.wait_ready()
        yield f"http://127.0.0.1:{port}"
    finally:
        process.stop()


def body(model: str, max_tokens: int, tag: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": f"Tell me about {tag}."}],
            "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}


async def fire(url: str, bodies: list[dict], keys: list[str | None] | None = None) -> list[httpx.Response]:
    keys = keys or [None] * len(bodies)
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        return await asyncio.gather(*(
            http.post("/v1/chat/completions", json=b, headers={"Authorization": f"Bearer {k}"} if k else {})
            for b, k in zip(bodies, keys, strict=True)
        ))


async def decisions(database_url: str, expected: dict[str, int], timeout_s: float = 30.0) -> Counter:
    """The admission_events decisions once at least `expected` of each have been recorded."""
    conn = await asyncpg.connect(database_url)

    async def seen() -> Counter:
        rows = await conn.fetch("SELECT decision, count(*) AS n FROM admission_events GROUP BY decision")
        return Counter({r["decision"]: r["n"] for r in rows})

    async def enough() -> Counter | None:
        counts = await seen()
        return counts if all(counts[k] >= v for k, v in expected.items()) else None

    try:
        try:
            return await eventually_async(enough, timeout_s)
        except AssertionError:
            return await seen()  # the caller's assertion says what is missing
    finally:
        await conn.close()


def test_overload_gives_exactly_the_expected_mix(system: System, slow_model: str, tmp_path: Path) -> None:
    # Limits for this model only, from the per-model file; other models stay unlimited.
    per_model = tmp_path / "admission.toml"
    per_model.write_text(f'[models."{slow_model}"]\nmax_in_flight = 2\nmax_queue_depth = 2\n')
    before = asyncio.run(decisions(system.database_url, {}))
    with gateway(system, HELEXA_ADMISSION_FILE=str(per_model)) as url:
        # Each holds its slot for seconds: all ten have arrived before the first one is done.
        responses = asyncio.run(fire(url, [body(slow_model, 24, f"hold {i}") for i in range(10)]))
    statuses = Counter(r.status_code for r in responses)
    assert statuses == {200: 4, 503: 6}
    for response in responses:
        if response.status_code == 503:
            assert int(response.headers["Retry-After"]) >= 1
            assert response.json()["error"]["code"] == "queue_full"
        else:
            assert response.json()["usage"]["completion_tokens"] == 24
    after = asyncio.run(decisions(system.database_url, {"queue_full": before["queue_full"] + 6}))
    assert after["queue_full"] - before["queue_full"] == 6


def test_per_principal_cap_is_429_while_another_principal_is_served(system: System, slow_model: str,
                                                                   tmp_path: Path) -> None:
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-heavy heavy\nsk-light light\n")
    with gateway(system, HELEXA_API_KEYS=str(keys), HELEXA_MAX_IN_FLIGHT="8", HELEXA_MAX_QUEUE_DEPTH="8",
                 HELEXA_MAX_PER_PRINCIPAL="2") as url:
        responses = asyncio.run(fire(url, [body(slow_model, 16, f"hold {i}") for i in range(4)],
                                     ["sk-heavy", "sk-heavy", "sk-heavy", "sk-light"]))
    heavy, light = responses[:3], responses[3]
    assert sorted(r.status_code for r in heavy) == [200, 200, 429]
    refused = next(r for r in heavy if r.status_code == 429)
    assert int(refused.headers["Retry-After"]) >= 1 and refused.json()["error"]["type"] == "rate_limit_error"
    assert light.status_code == 200


def test_waiting_longer_than_max_wait_is_503_and_never_runs(system: System, slow_model: str) -> None:
    with gateway(system, HELEXA_MAX_IN_FLIGHT="1", HELEXA_MAX_QUEUE_DEPTH="2", HELEXA_MAX_WAIT_S="0.5") as url:
        with httpx.Client(base_url=url, timeout=120) as http:
            # The long request (20 s of tokens) holds the only slot: its stream has begun before
            # the second is sent.
            with http.stream("POST", "/v1/chat/completions", json={**body(slow_model, 400, "hold long"),
                                                                   "stream": True}) as long:
                assert long.status_code == 200
                # Keep the line iterator referenced: dropping it would close the connection.
                lines = long.iter_lines()
                next(lines)
                short = http.post("/v1/chat/completions", json=body(slow_model, 4, "quick wait"))
                lines.close()
    assert short.status_code == 503 and short.json()["error"]["code"] == "queue_timeout"
    assert int(short.headers["Retry-After"]) >= 1
    seen = asyncio.run(decisions(system.database_url, {"timeout": 1}))
    assert seen["timeout"] >= 1


def admission_gauge(url: str, model: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "helexa:admission_pending" and sample.labels.get("model") == model:
                return sample.value
    return 0.0


def wait_for_gauge(url: str, model: str, value: float, timeout_s: float = 30.0) -> None:
    eventually(lambda: admission_gauge(url, model) == value, timeout_s,
               message=lambda: f"admission_pending stayed {admission_gauge(url, model)}, expected {value}")


def queue_then_hang_up(url: str, payload: dict, key: str) -> socket.socket:
    """A raw HTTP client that sends its request and will later just close the connection."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(payload).encode()
    conn = socket.create_connection((host, int(port)))
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 + f"Authorization: Bearer {key}\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    return conn


def test_cancelled_queued_waiters_leave_no_trace(system: System, slow_model: str, tmp_path: Path) -> None:
    """The regression that once pinned a model at 429: queued waiters that leave must give their
    reservations back, so the principal can queue again instead of being refused."""
    keys = tmp_path / "keys.txt"
    keys.write_text("sk-p p\n")
    # The newcomer waits out the whole running request (about 9 s of tokens).
    with gateway(system, HELEXA_API_KEYS=str(keys), HELEXA_MAX_IN_FLIGHT="1", HELEXA_MAX_QUEUE_DEPTH="2",
                 HELEXA_MAX_PER_PRINCIPAL="3", HELEXA_MAX_WAIT_S="600") as url:
        auth = {"Authorization": "Bearer sk-p"}
        with httpx.Client(base_url=url, timeout=120, headers=auth) as http:
            with http.stream("POST", "/v1/chat/completions",
                             json={**body(slow_model, 160, "hold running"), "stream": True}) as running:
                lines = running.iter_lines()
                next(lines)
                waiters = [queue_then_hang_up(url, body(slow_model, 4, f"quick waiter {i}"), "sk-p")
                           for i in range(2)]
                wait_for_gauge(url, slow_model, 3)
                for waiter in waiters:
                    waiter.close()
                wait_for_gauge(url, slow_model, 1)  # the queue is empty again

                with ThreadPoolExecutor(1) as pool:
                    newcomer = pool.submit(http.post, "/v1/chat/completions",
                                           json=body(slow_model, 4, "quick newcomer"))
                    wait_for_gauge(url, slow_model, 2)  # queued behind the running one, not refused
                    for _ in lines:
                        pass  # the running request finishes
                    assert newcomer.result().status_code == 200
        wait_for_gauge(url, slow_model, 0)


def test_a_request_past_its_deadline_is_dropped_by_the_worker_with_an_event(system: System) -> None:
    from apps.bus import connection, topology, wire
    from engine.frontend.protocol import SamplingParams

    request_id = f"expired-{time.monotonic_ns()}"

    async def publish_expired() -> None:
        nc = await connection.connect(system.nats_url, name="test")
        stale = wire.GenerateRequest(
            request_id=request_id, model=system.model, reply_subject=nc.new_inbox(), sampling=SamplingParams(),
            messages=[wire.ChatMessage(role="user", content="too late")], deadline=time.time() - 1,
        )
        await nc.jetstream().publish(topology.request_subject(system.model), wire.encode(stale),
                                     headers={"Nats-Msg-Id": request_id})
        await nc.close()

    async def recorded() -> tuple[asyncpg.Record, int]:
        conn = await asyncpg.connect(system.database_url)
        try:
            row = await eventually_async(
                lambda: conn.fetchrow("SELECT * FROM admission_events WHERE request_id = $1", request_id), 30)
            return row, await conn.fetchval("SELECT count(*) FROM runs WHERE request_id = $1", request_id)
        finally:
            await conn.close()

    asyncio.run(publish_expired())
    row, runs = asyncio.run(recorded())
    assert row["decision"] == "timeout" and row["node"] == "e2e-worker"
    assert runs == 0, "an expired request never starts"

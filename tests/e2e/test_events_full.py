"""A full EVENTS stream (issue 35), through real processes: EVENTS refuses new events rather than
dropping old ones, the gateway answers new requests 503 `events_full` with Retry-After (and says
so in a metric), the run that was streaming meanwhile finishes for its client and its refused
events are held and stored later, and once a recorder has recorded and trimmed the stream, every
event is in the ledger and requests are served again."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from apps.bus import connection, publish, topology, wire
from apps.bus.events import AdmissionDecided, AdmissionDecision
from apps.bus.topology import BusLimits
from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from tests.support import AppProcess, declared, eventually, migrated_database

MODEL = "full-model"
EVENTS_MAX_BYTES = 256 << 10
SCRIPT = {"rules": [{"match": "slow", "reply": " ".join(f"w{i}" for i in range(40)), "first_token_delay_s": 0.5,
                     "token_delay_s": 0.1}],
          "default": "ok"}


@pytest.fixture
def database_url(postgres: PostgresServer) -> Iterator[str]:
    yield asyncio.run(migrated_database(postgres, "full"))


async def fill(nats_url: str) -> int:
    """Admission events published until EVENTS refuses one; how many it took."""
    nc = await connection.connect(nats_url, "filler", max_reconnect_attempts=0)
    try:
        js = nc.jetstream()
        for n in range(10_000):
            event = AdmissionDecided(model=MODEL, node="filler", request_id=f"filler-{n}", principal=None,
                                          decision=AdmissionDecision.ADMITTED, detail="filler " + "x" * 900,
                                          pending=0, in_flight=0)
            try:
                await publish.publish(js, topology.event_subject("admission", MODEL), wire.encode(event),
                                      event.event_id)
            except publish.StreamFull:
                return n
        raise AssertionError("EVENTS never filled")
    finally:
        await nc.close()


async def stream_state(nats_url: str) -> tuple[int, int, int]:
    nc = await connection.connect(nats_url, "state", max_reconnect_attempts=0)
    try:
        state = (await nc.jetstream().stream_info(topology.EVENTS_STREAM)).state
        return state.first_seq, state.last_seq, state.messages
    finally:
        await nc.close()


def metric(url: str, name: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text)
    return sum(s.value for f in families for s in f.samples if s.name == name)


def ask(url: str, text: str = "hello") -> httpx.Response:
    return httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 100, "temperature": 0})


def test_a_full_events_stream_refuses_new_requests_and_loses_no_event(tmp_path: Path, database_url: str) -> None:
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT), encoding="utf-8")
    apps: list[AppProcess] = []
    with NatsServer(tmp_path / "nats", max_payload=None) as nats:
        declared(nats, BusLimits(event_max_bytes=EVENTS_MAX_BYTES))  # as helexa up: apps may not declare
        env = {"NATS_URL": nats.url, "DATABASE_URL": database_url, "HELEXA_EVENTS_MAX_BYTES": str(EVENTS_MAX_BYTES)}
        try:
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            gateway = AppProcess(["gateway"], {**env, "HELEXA_PORT": str(port)})
            worker = AppProcess(["worker", "--script", str(script), "--served-model-name", MODEL],
                                {**env, "HELEXA_NODE_ID": "full-worker", "HELEXA_STATUS_INTERVAL_S": "1"})
            apps += [gateway, worker]
            gateway.wait_ready()
            worker.wait_ready()
            eventually(lambda: MODEL in httpx.get(f"{url}/v1/models").text, 60, message="model listed")
            baseline = ask(url, "slow please")
            assert baseline.status_code == 200, baseline.text
            expected = baseline.json()["usage"]["completion_tokens"]

            # A stream that runs while EVENTS fills up: its run.finished will find no room.
            streamed: dict[str, object] = {}
            first_chunk = threading.Event()

            def slow_stream() -> None:
                body = {"model": MODEL, "messages": [{"role": "user", "content": "slow please"}], "stream": True,
                        "max_tokens": 100, "stream_options": {"include_usage": True}}
                with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=120) as answer:
                    streamed["status"] = answer.status_code
                    streamed["id"] = answer.headers.get("x-request-id")
                    for line in answer.iter_lines():
                        if line.startswith("data: {"):
                            first_chunk.set()
                            chunk = json.loads(line[6:])
                            if chunk.get("usage"):
                                streamed["tokens"] = chunk["usage"]["completion_tokens"]
                        if line == "data: [DONE]":
                            streamed["done"] = True

            streaming = threading.Thread(target=slow_stream)
            streaming.start()
            assert first_chunk.wait(60)
            fillers = asyncio.run(fill(nats.url))
            first_seq, last_seq, messages = asyncio.run(stream_state(nats.url))
            assert (first_seq, messages) == (1, last_seq), "a full EVENTS dropped nothing"

            refused = eventually(lambda: (r := ask(url)).status_code == 503 and r, 30, message="503 events_full")
            assert refused.json()["error"]["code"] == "events_full" and int(refused.headers["retry-after"]) > 0
            assert metric(url, "helexa:gateway_events_full") == 1
            assert metric(url, "helexa:admission_rejections_total") >= 1

            streaming.join(120)
            assert streamed["status"] == 200 and streamed.get("done") and streamed["tokens"] == expected
            assert asyncio.run(stream_state(nats.url))[0] == 1, "still nothing dropped"
            # The worker could not put the run's events on EVENTS: it holds them rather than dropping them.
            eventually(lambda: any(line.get("event") == "event held until EVENTS takes it"
                                   and line.get("request_id") == streamed["id"] for line in worker.lines), 30,
                       message="the streamed run's events held")

            # A recorder records everything and trims what it recorded: room again, nothing lost.
            recorder = AppProcess(["recorder"], {**env, "HELEXA_RECORDER_WATCH_S": "1"})
            apps.append(recorder)
            recorder.wait_ready()
            eventually(lambda: ask(url).status_code == 200, 90, message="requests served again")
            assert metric(url, "helexa:gateway_events_full") == 0

            async def ledger() -> tuple[int, str | None]:
                conn = await asyncpg.connect(database_url)
                try:
                    recorded = await conn.fetchval(
                        "SELECT count(*) FROM admission_events WHERE node = 'filler'")
                    status = await conn.fetchval("SELECT status FROM runs WHERE request_id = $1", streamed["id"])
                    return recorded, status
                finally:
                    await conn.close()

            # The fillers, and the streamed run's run.finished its worker held while EVENTS was full.
            eventually(lambda: asyncio.run(ledger()) == (fillers, "ok"), 90,
                       message=lambda: f"every event recorded: {asyncio.run(ledger())} of {fillers}")
        finally:
            for app in reversed(apps):
                app.stop()


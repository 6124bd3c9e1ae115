"""Faults that are not a dead worker: a NATS outage in the middle of streams, and a worker that
freezes past the ack wait and then wakes up while another worker serves its request."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import asyncpg
import httpx

from apps.bus import topology
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.recorder.migrate import migrate
from tests.fleet.conftest import Fleet, finished_subjects, own_fleet, wait_events
from tests.fleet.test_migration import MIGRATED_ATTEMPT, finished, stream_chat
from tests.support import AppProcess, eventually

LONG = " ".join(f"w{i}" for i in range(48))
SLOW_LONG = {"default": LONG, "rules": [{"match": "slow", "reply": LONG, "token_delay_s": 0.25}]}
# How long the bus is away: longer than the gateway's idle timeout and the workers' probe grace.
OUTAGE_S = 5.0


def test_a_nats_outage_mid_stream_loses_no_stream_silently(tmp_path: Path) -> None:
    """Eight streams, then the NATS server stops for 5 s and comes back on its port and store:
    every stream either has its whole text or ends with an explicit error event."""
    model = "outage-streams"
    server = NatsServer(tmp_path / "nats").start()
    try:
        with own_fleet(server, tmp_path, model, SLOW_LONG, ["outage-a", "outage-b"]) as (base_url, _):
            body = {"model": model, "messages": [{"role": "user", "content": "slow please"}]}
            texts = [threading.Event() for _ in range(8)]
            with ThreadPoolExecutor(8) as pool:
                answers = [pool.submit(stream_chat, base_url, body, has_text, 2) for has_text in texts]
                for has_text in texts:
                    assert has_text.wait(60)
                server.stop()
                time.sleep(OUTAGE_S)  # the outage itself: its length is the scenario, not a wait for an event
                server.start()
                got = [answer.result(timeout=180) for answer in answers]
    finally:
        server.stop()
    for streamed in got:
        assert streamed.done
        if streamed.errors:
            assert streamed.finish_reason is None and LONG.startswith(streamed.text)
            assert all(e["code"] for e in streamed.errors)
        else:
            assert streamed.text == LONG and streamed.finish_reason == "stop"


async def _served_row(database_url: str, request_id: str) -> tuple | None:
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT node, attempt, served_attempt, status FROM runs WHERE request_id = $1",
                                  request_id)
        return tuple(row) if row is not None else None
    finally:
        await conn.close()


def test_a_frozen_worker_that_wakes_up_stops_and_the_ledger_names_the_served_attempt(
        fleet: Fleet, own_postgres: PostgresServer) -> None:
    """SIGSTOP past the idle timeout: the stream migrates to the other worker; on SIGCONT the
    frozen attempt learns from its alive probe that it lost, stops, and says it did not serve.
    `runs` names the served attempt, live and after `helexa recorder --rebuild`."""
    model = "frozen-model"
    own_postgres.start()
    asyncio.run(migrate(own_postgres.url))
    ledger = {"NATS_URL": fleet.server.url_for("recorder"), "DATABASE_URL": own_postgres.url}
    recorder = AppProcess(["recorder"], ledger)
    recorder.wait_ready()
    with fleet.workers_of([("frozen-a", model, SLOW_LONG), ("frozen-b", model, SLOW_LONG)]) as workers:
        by_node = {"frozen-a": workers[0], "frozen-b": workers[1]}
        has_text = threading.Event()
        body = {"model": model, "messages": [{"role": "user", "content": "slow please"}]}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(stream_chat, fleet.base_url, body, has_text, 3)
            assert has_text.wait(60)
            running = wait_events(fleet.nats_url, topology.event_subject("run.started", model),
                                  lambda es: len(es) >= 1)[-1]
            frozen = by_node[running.node]
            frozen.process.send_signal(signal.SIGSTOP)
            try:
                # The other worker has taken over once the migrated attempt has started there.
                wait_events(fleet.nats_url, topology.event_subject("run.started", model),
                            lambda es: any(e.request_id == running.request_id and e.attempt == MIGRATED_ATTEMPT
                                           for e in es))
            finally:
                frozen.process.send_signal(signal.SIGCONT)
            got = answer.result(timeout=120)
        events = wait_events(fleet.nats_url, finished_subjects(model),
                             lambda es: any(e.error == "attempt_taken" for e in finished(es, running.request_id))
                             and any(e.attempt == MIGRATED_ATTEMPT for e in finished(es, running.request_id)))
    assert got.errors == [] and got.text == LONG and got.finish_reason == "stop"
    outcomes = finished(events, running.request_id)
    served = [(e.node, e.attempt) for e in outcomes if e.served]
    survivor = next(node for node in by_node if node != running.node)
    assert served == [(survivor, MIGRATED_ATTEMPT)]
    # The frozen attempt's own word, once awake: it lost, and served nothing more.
    woke = [e for e in outcomes if e.error == "attempt_taken"]
    assert [(e.node, e.attempt, e.served) for e in woke] == [(running.node, 1, False)]
    expected = (survivor, MIGRATED_ATTEMPT, MIGRATED_ATTEMPT, "ok")
    try:
        eventually(lambda: asyncio.run(_served_row(own_postgres.url, running.request_id)) == expected,
                   timeout_s=60, message="runs never named the served attempt")
    finally:
        recorder.stop()
    rebuilt = AppProcess(["recorder", "--rebuild"], ledger)
    try:
        rebuilt.wait_for(lambda e: e.get("event") == "rebuild finished", 120)
        assert asyncio.run(_served_row(own_postgres.url, running.request_id)) == expected
    finally:
        rebuilt.stop()


def test_a_full_request_queue_answers_503_queue_full_and_drops_nothing_queued(tmp_path: Path) -> None:
    """REQUESTS holds three messages: of eight requests at once, those it refuses get 503
    `queue_full` with Retry-After, and every one it took is answered."""
    model = "full-queue"
    with (NatsServer(tmp_path / "nats") as server,
          own_fleet(server, tmp_path, model, {"default": "served", "rules": []}, ["full-a"],
                    HELEXA_REQUESTS_MAX_MSGS="3", HELEXA_REQUEST_ACK_WAIT_S="30",
                    HELEXA_MAX_NUM_SEQS="1") as (base_url, (worker,))):
        worker.process.send_signal(signal.SIGSTOP)  # nothing leaves the queue meanwhile
        try:
            body = {"model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4}

            def ask(_: int) -> httpx.Response:
                return httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120)

            with ThreadPoolExecutor(8) as pool:
                pending = [pool.submit(ask, i) for i in range(8)]
                # The refusals come at once (the queue is full); the rest wait for the worker.
                eventually(lambda: sum(f.done() for f in pending) >= 5, timeout_s=60,
                           message="the queue never refused the requests past its limit")
                worker.process.send_signal(signal.SIGCONT)
                answers = [f.result(timeout=120) for f in pending]
        finally:
            with contextlib.suppress(ProcessLookupError):
                worker.process.send_signal(signal.SIGCONT)
    full = [a for a in answers if a.status_code == 503]
    served = [a for a in answers if a.status_code == 200]
    assert len(full) == 5 and len(served) == 3, [(a.status_code, a.text) for a in answers]
    assert all(a.json()["error"]["code"] == "queue_full" and "Retry-After" in a.headers for a in full)
    assert all(a.json()["choices"][0]["message"]["content"] == "served" for a in served)

"""The whole system for end-to-end and client-compatibility tests: recorder, worker (default model)
and gateway as real processes on a real NATS server and a real PostgreSQL. The `system` fixture is
registered in the root conftest, so `tests/e2e` and `tests/compat` share one per session."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.recorder.migrate import migrate
from tests.support import AppProcess

# Workers rewrite their node entries this often, so tests read fresh engine stats from /metrics.
STATUS_INTERVAL_S = 1.0


@dataclass
class System:
    base_url: str
    nats_url: str
    database_url: str
    model: str
    gateway: AppProcess
    worker: AppProcess
    recorder: AppProcess


@pytest.fixture(scope="session")
def system(nats_server: NatsServer, postgres: PostgresServer) -> Iterator[System]:
    asyncio.run(migrate(postgres.url))
    port = free_port()
    env = {"NATS_URL": nats_server.url, "DATABASE_URL": postgres.url, "HELEXA_PORT": str(port)}
    apps: list[AppProcess] = []
    try:
        recorder = AppProcess(["recorder"], env)
        apps.append(recorder)
        worker = AppProcess(["worker"], {**env, "HELEXA_NODE_ID": "e2e-worker",
                                         "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S)})
        apps.append(worker)
        gateway = AppProcess(["gateway"], env)
        apps.append(gateway)
        recorder.wait_ready()
        ready = worker.wait_ready()
        gateway.wait_ready()
        yield System(
            base_url=f"http://127.0.0.1:{port}",
            nats_url=nats_server.url,
            database_url=postgres.url,
            model=ready["model"],
            gateway=gateway,
            worker=worker,
            recorder=recorder,
        )
    finally:
        for app in reversed(apps):
            app.stop()


@contextmanager
def scripted_worker(system: System, folder: Path, name: str, script: dict,
                    env: dict[str, str] | None = None) -> Iterator[AppProcess]:
    """A worker that replies from `script` (same tokenizer, parsers and frames as a real one), so
    tool calls and thoughts happen when a test says; the reasoning parser is forced on because
    SmolLM2's template has no <think>."""
    path = folder / f"{name}.json"
    path.write_text(json.dumps(script), encoding="utf-8")
    worker = AppProcess(["worker", "--script", str(path), "--served-model-name", name],
                        {"NATS_URL": system.nats_url, "HELEXA_NODE_ID": f"e2e-{name}",
                         "HELEXA_REASONING_PARSER": "on", "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S),
                         **(env or {})})
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()

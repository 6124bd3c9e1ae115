"""The whole system for end-to-end and client-compatibility tests: recorder, worker (default model)
and gateway as real processes on a real NATS server and a real PostgreSQL. The `system` fixture is
registered in the root conftest, so `tests/e2e` and `tests/compat` share one per session.

Each app runs as `helexa up` runs it: with its own role's NATS user and PostgreSQL role
(`System.env_for(app)`), never the administrators'. `nats_url` and `database_url` are the
administrators', for tests that look at the bus or the ledger from outside."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import APP_ROLES, PostgresServer
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
    nats_server: NatsServer
    postgres: PostgresServer

    def env_for(self, app: str) -> dict[str, str]:
        """NATS_URL (and DATABASE_URL, for the apps with a ledger role) of `app`'s own role."""
        return role_env(self.nats_server, self.postgres, app)


def role_env(nats_server: NatsServer, postgres: PostgresServer | None, app: str) -> dict[str, str]:
    """`app`'s own credentials, as `helexa up` hands them to it."""
    env = {"NATS_URL": nats_server.url_for(app)}
    if postgres is not None and app in APP_ROLES:
        env["DATABASE_URL"] = postgres.role_url(app)
    return env


@pytest.fixture(scope="session")
def system(nats_server: NatsServer, postgres: PostgresServer) -> Iterator[System]:
    asyncio.run(migrate(postgres.url))
    asyncio.run(postgres.open_app_roles())
    port = free_port()
    apps: list[AppProcess] = []
    try:
        recorder = AppProcess(["recorder"], role_env(nats_server, postgres, "recorder"))
        apps.append(recorder)
        worker = AppProcess(["worker"], {**role_env(nats_server, postgres, "worker"), "HELEXA_NODE_ID": "e2e-worker",
                                         "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S)})
        apps.append(worker)
        # Batches run only on the gateways the batch tests start, so they know which one holds a batch.
        gateway = AppProcess(["gateway"], {**role_env(nats_server, postgres, "gateway"), "HELEXA_PORT": str(port),
                                           "HELEXA_BATCH_CONCURRENCY": "0"})
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
            nats_server=nats_server,
            postgres=postgres,
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
                        {**system.env_for("worker"), "HELEXA_NODE_ID": f"e2e-{name}",
                         "HELEXA_REASONING_PARSER": "on", "HELEXA_STATUS_INTERVAL_S": str(STATUS_INTERVAL_S),
                         **(env or {})})
    try:
        worker.wait_ready()
        yield worker
    finally:
        worker.stop()


@dataclass
class KeyedGateway:
    """A gateway of its own beside the system's, with API keys (`HELEXA_API_KEYS`), so tests can
    speak as several principals; `client()` speaks as `default_key`."""

    url: str
    process: AppProcess
    default_key: str

    def client(self, key: str | None = None) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key or self.default_key, max_retries=0, timeout=120)


def api_keys_file(folder: Path, principals: dict[str, str]) -> Path:
    """A `HELEXA_API_KEYS` file: one `KEY PRINCIPAL` line per entry of `principals` (key: principal)."""
    path = folder / "keys.txt"
    path.write_text("".join(f"{key} {principal}\n" for key, principal in principals.items()))
    return path


def keyed_gateway(system: System, keys: Path, default_key: str, port: int | None = None,
                  env: dict[str, str] | None = None) -> KeyedGateway:
    """Start a gateway on `port` (a free one by default) with the API keys in `keys`; ready when returned."""
    port = port or free_port()
    process = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port),
                                       "HELEXA_API_KEYS": str(keys), **(env or {})})
    process.wait_ready()
    return KeyedGateway(f"http://127.0.0.1:{port}", process, default_key)


def read_chat_stream(response: httpx.Response, first_text: threading.Event) -> dict:
    """A streamed chat completion (or completion: its choices carry `text`) read to its end: its
    text, finish reason, usage and error events; `first_text` is set when the first text arrives."""
    text, finish, usage, errors = [], None, None, []
    for line in response.iter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            errors.append(chunk["error"])
            continue
        for choice in chunk["choices"]:
            piece = choice["text"] if "text" in choice else choice["delta"].get("content")
            text.append(piece or "")
            finish = choice.get("finish_reason") or finish
            if piece:
                first_text.set()
        usage = chunk.get("usage") or usage
    return {"text": "".join(text), "finish": finish, "usage": usage, "errors": errors}

"""A fleet for tests: one NATS server, a gateway, and scripted workers started per test.

Bus timings are shortened (ack wait, heartbeats, node TTL, idle timeout) so deliveries after a
worker dies happen within seconds; every worker is a real `helexa worker` process replying from a
script with the default model's tokenizer, so several of them are cheap on two cores.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.js.api import DeliverPolicy

from apps.bus import wire
from apps.embedded import free_port
from apps.embedded.nats_server import NatsServer
from tests.support import AppProcess

FLEET_ENV = {
    "HELEXA_REQUEST_ACK_WAIT_S": "2",
    "HELEXA_MAX_DELIVER": "2",
    "HELEXA_HEARTBEAT_S": "0.5",
    "HELEXA_STATUS_INTERVAL_S": "0.5",
    "HELEXA_NODE_TTL_S": "6",
    "HELEXA_STREAM_IDLE_TIMEOUT_S": "3",
    "HELEXA_ACCEPT_TIMEOUT_S": "40",
}
COLD_MODEL = "cold-model"


@dataclass
class Fleet:
    nats_url: str
    base_url: str
    env: dict[str, str]
    folder: Path
    gateway: AppProcess
    workers: list[AppProcess] = field(default_factory=list)

    @contextmanager
    def worker(self, node: str, model: str, script: dict, **env: str) -> Iterator[AppProcess]:
        """A scripted worker serving `model` as node `node`, stopped when the block ends."""
        with self.workers_of([(node, model, script)], **env) as (worker,):
            yield worker

    @contextmanager
    def workers_of(self, specs: list[tuple[str, str, dict | None]], **env: str) -> Iterator[list[AppProcess]]:
        """Several scripted workers started together (they load in parallel)."""
        started = [self.start_worker(node, model, script, **env) for node, model, script in specs]
        try:
            for worker in started:
                worker.wait_ready()
            yield started
        finally:
            for worker in started:
                worker.stop()

    def start_worker(self, node: str, model: str, script: dict | None, **env: str) -> AppProcess:
        """A scripted worker, or (script None) one running the default model itself."""
        args = ["worker", "--served-model-name", model]
        if script is not None:
            path = self.folder / f"{node}.json"
            path.write_text(json.dumps(script), encoding="utf-8")
            args += ["--script", str(path)]
        return AppProcess(args, {**self.env, "HELEXA_NODE_ID": node, **env})

    @contextmanager
    def gateway_with(self, **env: str) -> Iterator[str]:
        """Another gateway on the fleet's bus, with settings of its own; yields its base URL."""
        port = free_port()
        gateway = AppProcess(["gateway"], {**self.env, "HELEXA_PORT": str(port), **env})
        try:
            gateway.wait_ready()
            yield f"http://127.0.0.1:{port}"
        finally:
            gateway.stop()

    def cli(self, *args: str) -> AppProcess:
        return AppProcess(list(args), self.env)


@contextmanager
def own_fleet(server: NatsServer, folder: Path, model: str, script: dict, nodes: list[str],
              **env: str) -> Iterator[tuple[str, list[AppProcess]]]:
    """A gateway and scripted workers of `model` (one per node name) on a NATS server of the
    test's own, every app with the fleet's timings and `env`; yields (base URL, the workers)."""
    port = free_port()
    app_env = {**FLEET_ENV, "NATS_URL": server.url, "HELEXA_PORT": str(port), **env}
    path = folder / f"{model}.json"
    path.write_text(json.dumps(script), encoding="utf-8")
    gateway = AppProcess(["gateway"], app_env)
    workers = [AppProcess(["worker", "--script", str(path), "--served-model-name", model],
                          {**app_env, "HELEXA_NODE_ID": node}) for node in nodes]
    try:
        for app in (gateway, *workers):
            app.wait_ready()
        yield f"http://127.0.0.1:{port}", workers
    finally:
        for app in (*reversed(workers), gateway):
            app.stop()


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("fleet")
    catalogue = folder / "catalogue.toml"
    catalogue.write_text(f'[models."{COLD_MODEL}"]\nsource = "default"\nmin_memory_mb = 100\n', encoding="utf-8")
    with NatsServer(folder / "nats") as server:
        port = free_port()
        env = {**FLEET_ENV, "NATS_URL": server.url, "HELEXA_PORT": str(port), "HELEXA_CATALOGUE": str(catalogue)}
        gateway = AppProcess(["gateway"], env)
        try:
            gateway.wait_ready()
            yield Fleet(nats_url=server.url, base_url=f"http://127.0.0.1:{port}", env=env, folder=folder,
                        gateway=gateway)
        finally:
            gateway.stop()


async def _collect(nats_url: str, subject: str, until: Callable[[list[wire.Event]], bool],
                   timeout_s: float) -> list[wire.Event]:
    nc = await nats.connect(nats_url)
    try:
        sub = await nc.jetstream().subscribe(subject, ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        events: list[wire.Event] = []
        deadline = time.monotonic() + timeout_s
        while not until(events):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"events on {subject} never satisfied the test: {events}")
            try:
                msg = await sub.next_msg(timeout=remaining)
            except TimeoutError:
                continue
            events.append(wire.event_decoder.decode(msg.data))
        return events
    finally:
        await nc.close()


def wait_events(nats_url: str, subject: str, until: Callable[[list[wire.Event]], bool],
                timeout_s: float = 60.0) -> list[wire.Event]:
    """EVENTS on `subject` from the stream's start, read until `until(events)` holds."""
    return asyncio.run(_collect(nats_url, subject, until, timeout_s))

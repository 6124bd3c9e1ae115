"""A fleet for tests: one NATS server, a gateway, and scripted workers started per test.

Bus timings are shortened (ack wait, heartbeats, node TTL, idle timeout) so deliveries after a
worker dies happen within seconds; every worker is a real `helexa worker` process replying from a
script with the default model's tokenizer, so several of them are cheap on two cores.

As in a real fleet, the administrator declares the topology with the fleet's limits (`helexa bus
setup`) and every app runs as its own role's NATS user (`Fleet.env_for`); the tests watch the bus
as the operator (`Fleet.nats_url`).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.js.api import DeliverPolicy

from apps.bus import topology
from apps.bus.events import Event, decode_events
from apps.embedded import free_port
from apps.embedded.nats_server import NatsCluster, NatsServer
from tests.support import REPO, AppProcess

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


def bus_setup(server: NatsServer | NatsCluster, env: dict[str, str]) -> None:
    """`helexa bus setup` as the server's administrator, with the limits `env` sets (HELEXA_*)."""
    done = subprocess.run([sys.executable, "-m", "apps.cli", "bus", "setup"], cwd=REPO, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env, "NATS_URL": server.url})
    assert done.returncode == 0, done.stdout + done.stderr


def role_env(server: NatsServer | NatsCluster, env: dict[str, str], role: str) -> dict[str, str]:
    return {**env, "NATS_URL": server.url_for(role)}


@dataclass
class Fleet:
    # The operator's: it reads everything, and loads and unloads models.
    nats_url: str
    base_url: str
    # The fleet's settings; each app adds its own role's NATS_URL (`env_for`).
    env: dict[str, str]
    folder: Path
    gateway: AppProcess
    server: NatsServer
    workers: list[AppProcess] = field(default_factory=list)

    def env_for(self, role: str) -> dict[str, str]:
        return role_env(self.server, self.env, role)

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
        return AppProcess(args, {**self.env_for("worker"), "HELEXA_NODE_ID": node, **env})

    @contextmanager
    def gateway_with(self, **env: str) -> Iterator[str]:
        """Another gateway on the fleet's bus, with settings of its own; yields its base URL."""
        port = free_port()
        gateway = AppProcess(["gateway"], {**self.env_for("gateway"), "HELEXA_PORT": str(port), **env})
        try:
            gateway.wait_ready()
            yield f"http://127.0.0.1:{port}"
        finally:
            gateway.stop()

    def cli(self, *args: str) -> AppProcess:
        return AppProcess(list(args), self.env_for("operator"))


@contextmanager
def own_fleet(server: NatsServer, folder: Path, model: str, script: dict, nodes: list[str],
              **env: str) -> Iterator[tuple[str, list[AppProcess]]]:
    """A gateway and scripted workers of `model` (one per node name) on a NATS server of the
    test's own, every app with the fleet's timings and `env`; yields (base URL, the workers)."""
    port = free_port()
    app_env = {**FLEET_ENV, "HELEXA_PORT": str(port), **env}
    bus_setup(server, app_env)
    path = folder / f"{model}.json"
    path.write_text(json.dumps(script), encoding="utf-8")
    gateway = AppProcess(["gateway"], role_env(server, app_env, "gateway"))
    workers = [AppProcess(["worker", "--script", str(path), "--served-model-name", model],
                          {**role_env(server, app_env, "worker"), "HELEXA_NODE_ID": node}) for node in nodes]
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
        env = {**FLEET_ENV, "HELEXA_PORT": str(port), "HELEXA_CATALOGUE": str(catalogue)}
        bus_setup(server, env)
        gateway = AppProcess(["gateway"], role_env(server, env, "gateway"))
        try:
            gateway.wait_ready()
            yield Fleet(nats_url=server.url_for("operator"), base_url=f"http://127.0.0.1:{port}", env=env,
                        folder=folder, gateway=gateway, server=server)
        finally:
            gateway.stop()


def finished_subjects(model: str) -> list[str]:
    """Where `model`'s `run.finished` events go: the workers' own, and the gateways' reports of runs
    whose worker was lost (`worker_lost`: run events are the workers')."""
    return [topology.event_subject("run.finished", model), topology.event_subject(topology.WORKER_LOST, model)]


async def _collect(nats_url: str, subject: str | list[str], until: Callable[[list[Event]], bool],
                   timeout_s: float) -> list[Event]:
    nc = await nats.connect(nats_url)
    wanted = [subject] if isinstance(subject, str) else subject
    try:
        # Several subjects: the whole stream, kept where it matches one of them.
        sub = await nc.jetstream().subscribe(wanted[0] if len(wanted) == 1 else topology.every_event(),
                                             ordered_consumer=True, deliver_policy=DeliverPolicy.ALL)
        events: list[Event] = []
        deadline = time.monotonic() + timeout_s
        while not until(events):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"events on {subject} never satisfied the test: {events}")
            try:
                msg = await sub.next_msg(timeout=remaining)
            except TimeoutError:
                continue
            if len(wanted) == 1 or msg.subject in wanted:
                events.extend(decode_events(msg.data))
        return events
    finally:
        await nc.close()


def wait_events(nats_url: str, subject: str | list[str], until: Callable[[list[Event]], bool],
                timeout_s: float = 60.0) -> list[Event]:
    """EVENTS on `subject` (or on any of several, exact) from the stream's start, read until
    `until(events)` holds."""
    return asyncio.run(_collect(nats_url, subject, until, timeout_s))

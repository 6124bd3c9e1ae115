"""`helexa up`: the whole system on one machine, kept running, stopped cleanly on Ctrl-C or SIGTERM.

Starts (unless NATS_URL / DATABASE_URL point elsewhere) an embedded NATS server and an embedded
PostgreSQL under the data directory, both locked with credentials kept there (see
`apps.embedded`), migrates, then supervises gateway, worker and recorder as child processes and
prints the URLs to reach everything, credentials included. A child that exits once the system is
up is started again after a backoff (1 s, doubling up to 30 s; back to 1 s after a minute of
running), so one crash does not stop the rest. Children are stopped before the servers they
depend on; all are waited for.

On one machine the engine is the work and everything else serves it: the servers, the gateway and
the recorder run at a lower CPU priority (`HELEXA_SERVICES_NICE`, 5; 0 keeps them level), the
worker, whose engine process does the generating, at ours. The engine's threads split each op of
a step between the cores; a service that takes a core from one of them mid-op stalls the other at
the op's end. Measured on 2 cores at 16 streams (`bench/cpu_peers.py`): 297 against 268 tok/s,
inter-token 44 against 51 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import ExitStack
from pathlib import Path

from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer, psql_binary
from apps.logs import announce_ready
from apps.settings import GatewaySettings, data_dir, services_nice

log = logging.getLogger("helexa.up")

APPS = ("recorder", "worker", "gateway")
# The apps that generate: they keep up's own priority (their engine processes inherit it).
ENGINE_APPS = frozenset({"worker"})
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
# A child running this long counts as healthy again: its next crash restarts it after FIRST_BACKOFF_S.
STABLE_AFTER_S = 60.0
SUPERVISE_EVERY_S = 0.2


class Child:
    """An app process whose log lines are passed through and watched for `ready`; restartable."""

    def __init__(self, app: str, env: dict[str, str], nice: int = 0) -> None:
        self.app = app
        self.env = env
        self.nice = nice
        self.restarts = 0
        self.backoff_s = FIRST_BACKOFF_S
        self.spawn()

    def spawn(self) -> None:
        self.ready = threading.Event()
        self.ready_fields: dict = {}
        self.started_at = time.monotonic()
        self.process = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", self.app],
            env=self.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        lower_priority(self.process.pid, self.nice)
        threading.Thread(target=self._pump, args=(self.process, self.ready), daemon=True).start()

    def _pump(self, process: subprocess.Popen[str], ready: threading.Event) -> None:
        assert process.stdout is not None
        for line in process.stdout:
            sys.stderr.write(line)
            if not ready.is_set() and '"ready"' in line:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == "ready":
                    self.ready_fields = entry
                    ready.set()

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.alive():
            self.process.terminate()
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def lower_priority(pid: int, nice: int) -> None:
    """Raise process `pid`'s niceness by `nice`, every thread it has (a thread it starts later
    inherits it from the one that starts it)."""
    if nice <= 0:
        return
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]  # no /proc: the process's main thread
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
        except OSError as exc:  # the thread ended, or the system refuses
            log.debug("could not lower a thread's priority", extra={"pid": pid, "tid": tid, "error": repr(exc)})


class Supervisor:
    """Restarts children that exit, each after its own backoff, until `stop` is set."""

    def __init__(self, children: list[Child], stop: threading.Event) -> None:
        self.children = children
        self.stop = stop
        self._due: dict[str, float] = {}  # app → monotonic time of its restart

    def run(self) -> None:
        while not self.stop.wait(SUPERVISE_EVERY_S):
            for child in self.children:
                self._look_after(child)

    def _look_after(self, child: Child) -> None:
        now = time.monotonic()
        if child.alive():
            if now - child.started_at >= STABLE_AFTER_S:
                child.backoff_s = FIRST_BACKOFF_S
            return
        if child.app not in self._due:
            ran_s = round(now - child.started_at, 1)
            if ran_s >= STABLE_AFTER_S:
                child.backoff_s = FIRST_BACKOFF_S
            self._due[child.app] = now + child.backoff_s
            log.warning("child exited, restarting", extra={
                "app": child.app, "returncode": child.process.returncode, "ran_s": ran_s,
                "restart_in_s": child.backoff_s, "restarts": child.restarts})  # fmt: skip
            child.backoff_s = min(child.backoff_s * 2, MAX_BACKOFF_S)
        elif now >= self._due[child.app]:
            del self._due[child.app]
            child.restarts += 1
            child.spawn()
            log.info("child restarted", extra={"app": child.app, "pid": child.process.pid,
                                               "restarts": child.restarts})


def _banner(url: str, model: str, nats_url: str, database_url: str, credential_files: list[Path]) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    psql = psql_binary() if Path(psql_binary()).exists() else "psql"
    where = "".join(f"  credentials (readable only by you): {path}\n" for path in credential_files)
    return (
        f"\nhelexa is up: {url}/v1 serving {model}\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        f"  OpenAI SDK: OpenAI(base_url=\"{url}/v1\", api_key=\"unused\")\n\n"
        f"  NATS_URL={nats_url}\n"
        f"  DATABASE_URL={database_url}\n"
        f"    nats --server '{nats_url}' sub 'helexa.>'\n"
        f"    {psql} '{database_url}'\n"
        f"{where}"
        "Press Ctrl-C to stop.\n"
    )


def _wait_until_ready(children: list[Child], stop: threading.Event) -> None:
    for child in children:
        while not child.ready.wait(0.2):
            if stop.is_set():
                raise RuntimeError("stopped")
            if not child.alive():
                # Before the system is up an exit is a failure to start (a bad model, a port in
                # use): report it rather than retry forever.
                raise RuntimeError(f"{child.app} did not start")


def run_up(args: argparse.Namespace) -> int:
    from apps.recorder.migrate import migrate

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    folder = Path(args.data_dir).resolve() if args.data_dir else data_dir()
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    if args.port:
        env["HELEXA_PORT"] = str(args.port)
    if args.model:
        env["HELEXA_MODEL"] = str(Path(args.model).resolve())
    gateway = GatewaySettings(port=args.port) if args.port else GatewaySettings()
    nice = services_nice()
    children: list[Child] = []
    credential_files: list[Path] = []
    with ExitStack() as servers:
        if not os.environ.get("NATS_URL"):
            nats_server = servers.enter_context(NatsServer(folder / "nats"))
            if nats_server.process is not None:
                lower_priority(nats_server.process.pid, nice)
            env["NATS_URL"] = nats_server.url
            credential_files.append(nats_server.credentials_file)
        if not os.environ.get("DATABASE_URL"):
            postgres = servers.enter_context(PostgresServer(folder / "postgres"))
            if postgres.process is not None:  # its backends, forked later, inherit it
                lower_priority(postgres.process.pid, nice)
            env["DATABASE_URL"] = postgres.url
            credential_files.append(postgres.credentials_file)
        try:
            asyncio.run(migrate(env["DATABASE_URL"]))
            children.extend(Child(app, env, 0 if app in ENGINE_APPS else nice) for app in APPS)
            _wait_until_ready(children, stop)
            model = next(c.ready_fields.get("model") for c in children if c.app == "worker")
            url = f"http://{gateway.host}:{gateway.port}"
            print(_banner(url, model, env["NATS_URL"], env["DATABASE_URL"], credential_files), flush=True)
            announce_ready("up", url=url, model=model, data_dir=str(folder))
            Supervisor(children, stop).run()
            return 0
        except RuntimeError as exc:
            if stop.is_set():
                return 0
            print(f"helexa: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            for child in reversed(children):
                child.stop()

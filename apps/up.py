"""`helexa up`: the whole system on one machine, stopped cleanly on Ctrl-C or SIGTERM.

Starts (unless NATS_URL / DATABASE_URL point elsewhere) an embedded NATS server and an embedded
PostgreSQL under the data directory, migrates, then supervises gateway, worker and recorder as
child processes. Children are stopped before the servers they depend on; all are waited for.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
from contextlib import ExitStack
from pathlib import Path

from apps.embedded.nats_server import NatsServer
from apps.embedded.postgres import PostgresServer
from apps.logs import announce_ready
from apps.settings import GatewaySettings, data_dir

READY_TIMEOUT_S = 600.0


class Child:
    """An app process whose log lines are passed through and watched for `ready`."""

    def __init__(self, app: str, env: dict[str, str]) -> None:
        self.app = app
        self.ready = threading.Event()
        self.ready_fields: dict = {}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "apps.cli", app],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
        )
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            sys.stderr.write(line)
            if not self.ready.is_set() and '"ready"' in line:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("event") == "ready":
                    self.ready_fields = entry
                    self.ready.set()

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


def _banner(url: str, model: str) -> str:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]})
    return (
        f"\nhelexa is up: {url}/v1 serving {model}\n\n"
        f"  curl {url}/v1/chat/completions -H 'Content-Type: application/json' \\\n"
        f"    -d '{body}'\n\n"
        f"  OpenAI SDK: OpenAI(base_url=\"{url}/v1\", api_key=\"unused\")\n"
        "Press Ctrl-C to stop.\n"
    )


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
    children: list[Child] = []
    with ExitStack() as servers:
        if not os.environ.get("NATS_URL"):
            env["NATS_URL"] = servers.enter_context(NatsServer(folder / "nats")).url
        if not os.environ.get("DATABASE_URL"):
            env["DATABASE_URL"] = servers.enter_context(PostgresServer(folder / "postgres")).url
        try:
            asyncio.run(migrate(env["DATABASE_URL"]))
            for app in ("recorder", "worker", "gateway"):
                children.append(Child(app, env))
            for child in children:
                while not child.ready.wait(0.2):
                    if stop.is_set() or not child.alive():
                        raise RuntimeError(f"{child.app} did not start" if not stop.is_set() else "stopped")
            model = next(c.ready_fields.get("model") for c in children if c.app == "worker")
            url = f"http://{gateway.host}:{gateway.port}"
            print(_banner(url, model), flush=True)
            announce_ready("up", url=url, model=model, data_dir=str(folder))
            while not stop.wait(0.5):
                dead = [c.app for c in children if not c.alive()]
                if dead:
                    print(f"helexa: {', '.join(dead)} exited; stopping", file=sys.stderr, flush=True)
                    return 1
            return 0
        except RuntimeError as exc:
            if stop.is_set():
                return 0
            print(f"helexa: {exc}", file=sys.stderr, flush=True)
            return 1
        finally:
            for child in reversed(children):
                child.stop()


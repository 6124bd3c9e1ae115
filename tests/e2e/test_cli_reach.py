"""How a `helexa` command reaches the system when nothing is exported: the env file of a live
`helexa up`, and one line within seconds when there is nothing to reach. The embedded servers'
credentials go only to a live `up`: a process now listening on a stopped one's port gets nothing."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from apps.embedded import free_port
from apps.embedded.data_dir import write_env
from tests.support import REPO

SECRET = "s3cret-password"


class FakeNats:
    """A listener on a port a stopped `up`'s NATS had: it greets like nats-server, records what
    clients send, and refuses them."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen()
        self.port = self.sock.getsockname()[1]
        self.received: list[bytes] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn:
                conn.sendall(b'INFO {"server_id":"fake","version":"2.10.0","host":"127.0.0.1","port":%d,'
                             b'"max_payload":1048576,"proto":1,"auth_required":true}\r\n' % self.port)
                conn.settimeout(5)
                try:
                    self.received.append(conn.recv(4096))
                    conn.sendall(b"-ERR 'Authorization Violation'\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def fake_nats() -> Iterator[FakeNats]:
    server = FakeNats()
    yield server
    server.close()


def helexa(args: list[str], env: dict[str, str], timeout_s: float = 15) -> subprocess.CompletedProcess[str]:
    """Run a `helexa` command to its end; it must end within `timeout_s`."""
    clean = {k: v for k, v in os.environ.items() if k not in ("NATS_URL", "DATABASE_URL", "HELEXA_URL")}
    return subprocess.run([sys.executable, "-m", "apps.cli", *args], cwd=REPO, env={**clean, **env},
                          capture_output=True, text=True, timeout=timeout_s)


@pytest.mark.parametrize("exported", [True, False], ids=["NATS_URL-exported", "NATS_URL-unset"])
def test_models_ls_with_no_server_fails_in_one_line_naming_nats_url(tmp_path: Path, exported: bool) -> None:
    env = {"HELEXA_DATA_DIR": str(tmp_path / "data")}
    if exported:
        env["NATS_URL"] = f"nats://127.0.0.1:{free_port()}"
    done = helexa(["models", "ls"], env)
    assert done.returncode != 0
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert line.startswith("helexa: cannot reach NATS at 127.0.0.1:") and "NATS_URL" in line, line


def _stopped_up(folder: Path, port: int) -> str:
    """A data directory a `helexa up` wrote its env file in, then stopped (no live lock)."""
    url = f"nats://helexa:{SECRET}@127.0.0.1:{port}"
    write_env(folder, {"NATS_URL": url, "HELEXA_URL": "http://127.0.0.1:8000"})
    (folder / "up.lock").write_text("999999\n")
    return url


@pytest.mark.parametrize("exported", [True, False], ids=["sourced-env-file", "env-file-only"])
def test_a_stopped_ups_credentials_never_reach_its_old_port(tmp_path: Path, fake_nats: FakeNats,
                                                             exported: bool) -> None:
    url = _stopped_up(tmp_path, fake_nats.port)
    done = helexa(["--data-dir", str(tmp_path), "models", "ls"], {"NATS_URL": url} if exported else {})
    assert done.returncode != 0
    (line,) = done.stderr.splitlines()
    assert "`helexa up` is not running from" in line and "NATS_URL" in line, line
    assert SECRET not in line
    assert fake_nats.received == []


LIVE_UP = """
import sys, time
from pathlib import Path
from apps.embedded.data_dir import UpLock
UpLock(Path(sys.argv[1])).acquire()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_live_ups_env_file_is_used_when_nothing_is_exported(tmp_path: Path, fake_nats: FakeNats) -> None:
    """The same data directory while an `up` holds its lock: the command does use the file's URL
    (here the fake server refuses it, so the command fails, saying where the URL came from)."""
    _stopped_up(tmp_path, fake_nats.port)
    holder = subprocess.Popen([sys.executable, "-c", LIVE_UP, str(tmp_path)], cwd=REPO, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "locked\n"
        done = helexa(["--data-dir", str(tmp_path), "models", "ls"], {})
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode != 0
    (line,) = done.stderr.splitlines()
    assert f"127.0.0.1:{fake_nats.port}" in line and "NATS_URL came from" in line, line
    assert SECRET not in line
    assert any(SECRET.encode() in sent for sent in fake_nats.received)

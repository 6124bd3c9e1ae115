"""How an operator's command reaches the system: the data directory's env file, and one bounded try.

`use_data_dir` runs before every `helexa` command but `up`: where `NATS_URL`, `DATABASE_URL` or
`HELEXA_URL` is unset, it takes the value from the env file of the `helexa up` running from the
data directory (`--data-dir`, HELEXA_DATA_DIR or `.helexa`). The embedded servers' credentials
are only sent while that `up` is alive (its lock is held): once it has stopped, another process may
listen on its old ports, so neither the file's values nor the same values exported from an old
`source .helexa/env` are used.

`connect_nats` tries for a few seconds, quietly, and fails with one line that says what it could
not reach, where the URL came from and how to set it: a CLI must not retry forever.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats.errors
from nats.aio.client import Client as NatsClient

from apps.bus import connection, roles
from apps.bus.connection import without_password
from apps.embedded.data_dir import ENV_FILE, ENV_NAMES, display_path, live_pid, read_env

# A CLI gives up on NATS after this long (a server that does not answer at all, not just refuses).
CONNECT_TIMEOUT_S = 10.0
# Connection attempts after the first (0.5 s apart) before a refused connection is final.
CONNECT_RETRIES = 3

# Where each variable came from: "exported", "env file", "stale" (a stopped `up`'s), or "unset".
_sources: dict[str, str] = {}
_folder: Path | None = None


class Unreachable(Exception):
    """A server the command needs could not be reached; the message is the one line to print."""


def use_data_dir(folder: Path) -> None:
    """Fill the unset variables from the env file of a live `helexa up` in `folder`; drop a stopped
    one's values where they were exported (see the module docstring)."""
    global _folder
    _folder = folder
    values = read_env(folder)
    live = live_pid(folder) is not None if values else False
    for name in ENV_NAMES:
        exported = os.environ.get(name, "").strip()
        if name not in values:
            _sources[name] = "exported" if exported else "unset"
        elif live and not exported:
            os.environ[name] = values[name]
            _sources[name] = "env file"
        elif not live and (not exported or exported == values[name]):
            os.environ.pop(name, None)
            _sources[name] = "stale"
        else:
            _sources[name] = "exported"


def unreachable(what: str, name: str, url: str, cause: BaseException | None) -> Unreachable:
    """The one line for a server `what` (NATS, PostgreSQL) that could not be reached at `url`,
    which came from the variable `name`; `cause` is what the last attempt raised (None: a timeout)."""
    env_file = display_path(_folder / ENV_FILE) if _folder is not None else ENV_FILE
    source = _sources.get(name, "exported" if os.environ.get(name) else "unset")
    if source == "exported":
        how = f"check {name}"
    elif source == "env file":
        how = f"{name} came from {env_file}; is its `helexa up` still starting?"
    elif source == "stale":
        how = f"`helexa up` is not running from {display_path(_folder or Path('.'))}: start it, or set {name}"
    else:
        how = f"{name} is not set: start `helexa up` (then `source {env_file}`), or set {name}"
    return Unreachable(f"helexa: cannot reach {what} at {without_password(url)} ({_reason(cause)}); {how}")


def _reason(exc: BaseException | None) -> str:
    if exc is None or isinstance(exc, TimeoutError):
        return f"no answer within {CONNECT_TIMEOUT_S:g} s"
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, nats.errors.AuthorizationError):
        return "wrong credentials"
    return str(exc) or type(exc).__name__


async def connect_nats(url: str, name: str, closed_cb: Callable[[], Awaitable[None]] | None = None) -> NatsClient:
    """A NATS connection for a CLI command, or Unreachable within CONNECT_TIMEOUT_S. Once
    connected, a lost server is retried CONNECT_RETRIES times, then the connection closes."""
    errors: list[BaseException] = []

    async def note(exc: Exception) -> None:  # instead of nats-py's traceback per attempt
        errors.append(exc)

    try:
        return await asyncio.wait_for(
            connection.connect(url, name=name, role=roles.OPERATOR, max_reconnect_attempts=CONNECT_RETRIES,
                             error_cb=note, closed_cb=closed_cb),
            CONNECT_TIMEOUT_S)
    except (OSError, TimeoutError, nats.errors.Error) as exc:
        raise unreachable("NATS", "NATS_URL", url, errors[-1] if errors else exc) from None

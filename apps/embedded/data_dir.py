"""What one `helexa up` keeps in its data directory besides the servers' data: its lock and its env file.

- `up.lock`: one `helexa up` per data directory. It holds an `flock` on the file for as long as it
  runs (the kernel releases it when the process dies, however it dies) and writes its pid in it,
  so a second start can name the first, and a CLI command can tell a live `up` from a stale file.
- `env`: the URLs of the running system, written at every start for `source .helexa/env`:
  `NATS_URL` (the operator's NATS user: reads everything), `DATABASE_URL` (the read-only ledger
  role), both with credentials, hence mode 0600, `HELEXA_URL`, the gateway, and
  `HELEXA_BENCH_NATS_URL` (the bench's NATS user). The CLI reads it when those variables are unset
  (`apps.fleet.operator`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import shlex
import time
from pathlib import Path

from apps.embedded.credentials import FILE_MODE

LOCK_FILE = "up.lock"
ENV_FILE = "env"
# The variables the env file sets, in the order it sets them.
ENV_NAMES = ("NATS_URL", "DATABASE_URL", "HELEXA_URL", "HELEXA_BENCH_NATS_URL")


class AlreadyRunning(Exception):
    """Another live `helexa up` holds this data directory's lock."""

    def __init__(self, folder: Path, pid: int | None) -> None:
        self.folder = folder
        self.pid = pid
        super().__init__(f"helexa is already running from {display_path(folder)} (pid {pid or 'unknown'}); "
                         "stop it or use another --data-dir")


def display_path(path: Path) -> str:
    """`path` relative to the working directory when it lies under it (as a user would type it)."""
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


class UpLock:
    """`with UpLock(folder):` holds the data directory for this process; raises AlreadyRunning."""

    def __init__(self, folder: Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self, wait_s: float = 1.0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        # A CLI command's probe (`live_pid`) holds a shared lock for an instant: try for a moment.
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EWOULDBLOCK, errno.EACCES) or time.monotonic() >= deadline:
                    os.close(fd)
                    if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
                        raise AlreadyRunning(self.path.parent, _read_pid(self.path)) from None
                    raise
                time.sleep(0.05)
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor releases the flock
            self._fd = None

    def __enter__(self) -> UpLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text(encoding="ascii").strip())
    except (OSError, ValueError):
        return None


def live_pid(folder: Path) -> int | None:
    """The pid of the `helexa up` running from `folder` now, or None when none holds its lock."""
    path = Path(folder) / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES):
            return _read_pid(path) or -1
        raise
    finally:
        os.close(fd)  # also releases the shared lock, when we got it
    return None


def write_env(folder: Path, values: dict[str, str]) -> Path:
    """Write `<folder>/env` (0600 from the start, replaced atomically): one `export NAME=value` a line."""
    path = Path(folder) / ENV_FILE
    partial = path.with_name(f".{ENV_FILE}.{os.getpid()}.tmp")
    lines = ["# Written by `helexa up` at each start; `source` it. It holds passwords: keep it to yourself."]
    lines += [f"export {name}={shlex.quote(values[name])}" for name in ENV_NAMES if values.get(name)]
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write("\n".join(lines) + "\n")
        os.chmod(partial, FILE_MODE)
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def read_env(folder: Path) -> dict[str, str]:
    """The variables `<folder>/env` exports (empty when there is no such file)."""
    try:
        text = (Path(folder) / ENV_FILE).read_text(encoding="utf-8")
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if len(words) == 2 and words[0] == "export" and "=" in words[1]:
            name, value = words[1].split("=", 1)
            if name in ENV_NAMES:
                found[name] = value
    return found

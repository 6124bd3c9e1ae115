"""A build lock the kernel releases when its holder dies: `flock` on a file of our own.

torch's extension builder guards a build directory with a baton file (`lock`, created with
O_EXCL, removed when the build ends): a start killed while it compiles leaves the file behind, and
every later start waits on it forever. An `flock` belongs to an open file: when the process holding
it dies, by any signal, the kernel drops it, so the next start takes it at once. The holder writes
its pid and since when it holds the lock into the file, so a start that has to wait says on whom.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a lock, as it wrote itself into the lock file (pid 0: not written yet)."""

    pid: int
    since: float

    def describe(self) -> str:
        """'pid 1234 since 14:02:31' (local time), or 'another process' before it has written."""
        if not self.pid:
            return "another process"
        return f"pid {self.pid} since {time.strftime('%H:%M:%S', time.localtime(self.since))}"


def read_holder(path: Path) -> Holder:
    """The holder a lock file names; Holder(0, 0) when it names none alive (free, or just taken
    and not yet written over a dead holder's record)."""
    try:
        entry = json.loads(path.read_text())
        holder = Holder(int(entry["pid"]), float(entry["since"]))
    except (OSError, ValueError, KeyError, TypeError):
        return Holder(0, 0.0)
    try:
        os.kill(holder.pid, 0)
    except ProcessLookupError:
        return Holder(0, 0.0)
    except PermissionError:  # alive, another user's
        pass
    return holder


@contextmanager
def build_lock(path: Path, on_wait: Callable[[Holder], None] | None = None) -> Iterator[None]:
    """Hold an exclusive `flock` on `path` (created if missing) for the block. Where another process
    holds it, `on_wait(holder)` is called once, then this blocks until the holder ends its block
    or dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    # Not inheritable (Python's default): a compiler this process starts must not keep the lock
    # alive after us.
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(read_holder(path))
            fcntl.flock(fd, fcntl.LOCK_EX)
        # Written through the locked descriptor, in place: the file itself is never replaced or
        # removed (a process blocked in flock on the old inode would otherwise hold a lock nobody sees).
        record = json.dumps({"pid": os.getpid(), "since": time.time()}).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, record, 0)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)
    finally:
        os.close(fd)  # drops the flock

"""Credentials of the embedded servers: generated on first start, kept in the data directory.

One JSON file per server (`{"user": ..., "password": ...}`), readable by its owner only (0600),
written atomically, reused on every later start so saved URLs keep working. Passwords are URL-safe
(letters, digits, `-`, `_`), so they go into `nats://` and `postgresql://` URLs unchanged.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("helexa.embedded")

FILE_MODE = 0o600


@dataclass(slots=True, frozen=True)
class Credentials:
    user: str
    password: str


def generate(user: str) -> Credentials:
    return Credentials(user, secrets.token_urlsafe(24))


def write(path: Path, credentials: Credentials) -> None:
    """Write atomically with mode 0600 from the start (never briefly readable by others)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            json.dump({"user": credentials.user, "password": credentials.password}, out)
        os.chmod(partial, FILE_MODE)  # O_CREAT's mode does not apply to a leftover file
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def read(path: Path) -> Credentials | None:
    """The stored credentials, or None when there are none (or the file is unreadable as such)."""
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
        found = Credentials(str(entry["user"]), str(entry["password"]))
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError):
        log.warning("unreadable credentials file, making new credentials", extra={"path": str(path)})
        return None
    if stat.S_IMODE(path.stat().st_mode) != FILE_MODE:
        log.warning("credentials file was readable by others; now 0600", extra={"path": str(path)})
        os.chmod(path, FILE_MODE)
    return found


def load_or_create(path: Path, user: str) -> tuple[Credentials, bool]:
    """The credentials stored at `path`, or new ones written there; True when they are new."""
    found = read(path)
    if found is not None:
        return found, False
    made = generate(user)
    write(path, made)
    return made, True

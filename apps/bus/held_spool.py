"""Events EVENTS has not taken yet, kept on disk until it does, so a process that dies (or stops)
while holding some does not lose them: the next process of its role on the machine publishes them.

One file per event, `<event id>.json` (the subject it goes under, and the event), written whole
under a temporary name and renamed, so a crash leaves either the whole file or none (a temporary
one left is removed at the next start); readable by the process's user only (0600 in 0700
folders): an event may hold a client's text. The folder is
the data directory's `held-events/<EVENTS>/<role>`: `<EVENTS>` names the EVENTS stream by when it
was created (a stream made again, or another test's server, never receives events held for
another), and each role replays only its own (its NATS user may publish only its own subjects).
A replayed event that was stored after all before its process died is stored once: its event id
is its `Nats-Msg-Id` and the ledger's key.

At most `MAX_SPOOL_BYTES` per process; an event past it is held in memory only, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from pathlib import Path

import msgspec

from apps.bus.events import AnyEvent

log = logging.getLogger("helexa.bus")

MAX_SPOOL_BYTES = 64 << 20
_FILE_NAME = re.compile(r"[0-9A-Za-z_-][0-9A-Za-z_.+-]{0,127}")


class _Spooled(msgspec.Struct, frozen=True):
    subject: str
    event: AnyEvent


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_Spooled)


class HeldSpool:
    """A folder of held events: written and removed from worker threads (file I/O stays off the
    event loop), loaded once when a process starts."""

    def __init__(self, folder: Path, max_bytes: int = MAX_SPOOL_BYTES) -> None:
        self.folder = folder
        self.max_bytes = max_bytes
        self._sizes: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def write(self, subject: str, event: AnyEvent) -> bool:
        """Keep `event` until `remove`; False when it is not kept (no room, an odd id, a disk error)."""
        name = event.event_id
        if not _FILE_NAME.fullmatch(name):
            return False
        body = _encoder.encode(_Spooled(subject, event))
        with self._lock:
            if sum(self._sizes.values()) + len(body) > self.max_bytes:
                log.warning("held event kept in memory only: the spool is full",
                            extra={"event_id": name, "spool_bytes": self.max_bytes})
                return False
            self._sizes[name] = len(body)
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            temporary = self.folder / f".{name}.tmp"
            # Clients' text (a stored response's input and output): readable by this user only.
            descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(descriptor, "wb") as file:
                file.write(body)
                file.flush()
                os.fsync(file.fileno())
            os.replace(temporary, self.folder / f"{name}.json")
        except OSError as exc:
            log.warning("held event kept in memory only: it could not be written",
                        extra={"event_id": name, "error": repr(exc)})
            with self._lock:
                self._sizes.pop(name, None)
            return False
        return True

    def remove(self, event_id: str) -> None:
        """`event_id` was stored: its file goes."""
        with self._lock:
            self._sizes.pop(event_id, None)
        try:
            (self.folder / f"{event_id}.json").unlink(missing_ok=True)
        except OSError as exc:
            log.warning("a stored event's spool file could not be removed", extra={"event_id": event_id,
                                                                                  "error": repr(exc)})

    def load(self) -> list[tuple[str, AnyEvent]]:
        """The events held here by earlier processes, oldest first (event ids sort by time). A file
        that cannot be read is renamed `.bad` and left for an operator."""
        try:
            if not self.folder.is_dir():
                return []
            for unfinished in self.folder.glob(".*.tmp"):  # a write its process did not finish
                unfinished.unlink(missing_ok=True)
        except OSError as exc:
            log.error("the held-event spool cannot be read", extra={"spool": str(self.folder), "error": repr(exc)})
            return []
        found: list[tuple[str, AnyEvent]] = []
        for path in sorted(self.folder.glob("*.json")):
            try:
                body = path.read_bytes()
                spooled = _decoder.decode(body)
            except (OSError, msgspec.DecodeError) as exc:
                log.error("a held event's spool file cannot be read; renamed .bad",
                          extra={"path": str(path), "error": repr(exc)[:300]})
                with contextlib.suppress(OSError):
                    path.replace(path.with_suffix(".bad"))
                continue
            with self._lock:
                self._sizes[spooled.event.event_id] = len(body)
            found.append((spooled.subject, spooled.event))
        return found

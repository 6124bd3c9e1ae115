"""Structured JSON logs, one object per line on stderr, with fixed keys for each kind of event.

Every text field of a line is bounded (`MAX_FIELD_BYTES`): an error's repr, a model id or any
other text a client influenced cannot make a log line (and the disk under it) as large as it likes.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from apps.bus.wire import bounded_text

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}
# Longest text one field of a log line keeps (a traceback, `exc`, is the program's own and is kept whole).
MAX_FIELD_BYTES = 2048


def _bounded(value: Any) -> Any:
    if isinstance(value, str):
        return bounded_text(value, MAX_FIELD_BYTES)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    text = json.dumps(value, default=str) if isinstance(value, (list, tuple, dict)) else str(value)
    if len(text) <= MAX_FIELD_BYTES and isinstance(value, (list, tuple, dict)):
        return value
    return bounded_text(text, MAX_FIELD_BYTES)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": _bounded(record.getMessage()),
        }
        entry.update({k: _bounded(v) for k, v in record.__dict__.items() if k not in _RESERVED})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure(level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # uvicorn's own start and stop chatter is INFO; the gateway says `ready` itself, and `up`
    # says one line per service when it stops them.
    for noisy in ("nats", "asyncio", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def announce_ready(app: str, **fields: Any) -> None:
    """The one line supervisors and tests wait for: the app is serving."""
    logging.getLogger(f"helexa.{app}").info("ready", extra={"app": app, **fields})


def monotonic_ms(since: float) -> float:
    return round((time.monotonic() - since) * 1000.0, 3)

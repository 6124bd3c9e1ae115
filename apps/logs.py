"""Structured JSON logs, one object per line on stderr, with fixed keys for each kind of event."""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

_RESERVED = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        entry.update({k: v for k, v in record.__dict__.items() if k not in _RESERVED})
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

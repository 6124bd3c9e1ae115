"""The ids the OpenAI-style APIs mint for a generation (`chatcmpl-…`, `cmpl-…`); the bus, the
worker and the ledger carry them as they are."""

from __future__ import annotations

import uuid


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"

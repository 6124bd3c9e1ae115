"""`helexa batches ls|show|cancel`: the Batch API as an operator's command, over the gateway's HTTP
API with an API key, exactly as the `openai` SDK reads it (so it sees what that key's principal
sees: its own batches, or every batch in keyless mode).

The gateway is `HELEXA_URL` (the env file of a live `helexa up` fills it in) or `--url`; the key is
`--api-key`, `HELEXA_API_KEY` or `OPENAI_API_KEY`. Each command prints JSON: `ls` one line per
batch (newest first, at most `--limit`), `show` and `cancel` the batch object.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx

from apps.fleet.operator import Unreachable

# A CLI gives up on the gateway after this long.
TIMEOUT_S = 30.0
# The most batches `ls` asks for (the API's own bound on `limit`).
MAX_LIMIT = 100
_SUMMARY = ("id", "status", "endpoint", "created_at", "request_counts", "output_file_id", "error_file_id")


class Refused(Exception):
    """The gateway answered with an error; the message is its own."""


def gateway_url(given: str | None) -> str:
    url = (given or os.environ.get("HELEXA_URL", "")).strip().rstrip("/")
    if not url:
        raise Unreachable("helexa batches: HELEXA_URL is not set: start `helexa up` (then `source .helexa/env`), "
                          "or pass --url")
    return url


def api_key(given: str | None) -> str:
    return given or os.environ.get("HELEXA_API_KEY") or os.environ.get("OPENAI_API_KEY") or "unused"


def run(action: str, batch_id: str, url: str, key: str, limit: int) -> list[dict[str, Any]]:
    """The JSON objects `action` prints; Refused or Unreachable when it cannot."""
    if action != "ls" and not batch_id:
        raise Refused(f"helexa batches {action} needs a batch id")
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=f"{url}/v1", headers=headers, timeout=TIMEOUT_S) as client:
        try:
            if action == "ls":
                page = _answer(client.get("/batches", params={"limit": max(1, min(limit, MAX_LIMIT))}))
                return [{name: batch.get(name) for name in _SUMMARY} for batch in page.get("data", [])]
            if action == "show":
                return [_answer(client.get(f"/batches/{batch_id}"))]
            return [_answer(client.post(f"/batches/{batch_id}/cancel"))]
        except httpx.TransportError as exc:
            raise Unreachable(f"helexa: cannot reach the gateway at {url} ({exc or type(exc).__name__}); "
                              "check HELEXA_URL or --url") from None


def _answer(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except json.JSONDecodeError:
        body = {}
    if response.is_success and isinstance(body, dict):
        return body
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    raise Refused(f"{response.status_code}: {message or response.text[:200]}")

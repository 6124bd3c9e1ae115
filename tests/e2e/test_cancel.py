"""A client that hangs up mid-stream stops its generation; the ledger says it was cancelled."""

from __future__ import annotations

import asyncio
import json

import httpx

from tests.e2e.conftest import System
from tests.e2e.test_chat import finished_run

LONG = 2000


def test_disconnect_mid_stream_aborts_the_generation(system: System) -> None:
    body = {
        "model": system.model,
        "messages": [{"role": "user", "content": "Count from one to a thousand."}],
        "max_tokens": LONG,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.Client(base_url=system.base_url, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            request_id = None
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: "):])
                    request_id = chunk["id"]
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        break
            assert request_id is not None
        # Leaving the block closes the connection mid-stream.
    row = asyncio.run(finished_run(system, request_id))
    assert row["status"] == "cancelled"
    assert row["finish_reason"] == "abort"
    assert 0 < row["completion_tokens"] < LONG

"""2001 `guided_choice` entries on the real model (issue 35): llguidance refuses them at the first
token ("max is 2000") with an error that goes on with the parser's state and the whole grammar,
and each character per choice adds 2001 bytes to it, so its size was the client's to choose (the
same error sized into the 1 MiB payload window is `test_bounded_ledger`'s scripted case). Whether
the gateway refuses such a request at the edge or the worker fails it, the worker stays on the
bus, a stream running beside it finishes with every token, and a recorded error is its first line,
at most 1 KB."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime

import asyncpg
import httpx

from tests.e2e.conftest import System
from tests.support import eventually

STREAM_TOKENS = 24


async def _stream(http: httpx.AsyncClient, model: str) -> tuple[int, str | None]:
    body = {"model": model, "messages": [{"role": "user", "content": "Count slowly."}], "stream": True,
            "max_tokens": STREAM_TOKENS, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True}}
    tokens, finish = -1, None
    async with http.stream("POST", "/v1/chat/completions", json=body) as answer:
        assert answer.status_code == 200
        async for line in answer.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                tokens = chunk["usage"]["completion_tokens"] if chunk.get("usage") else tokens
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
    return tokens, finish


def test_2001_long_choices_leave_the_worker_connected_and_other_streams_whole(system: System) -> None:
    # An error of about 850 KB (it grows by 2001 bytes a character), the grammar under its 1 MiB bound.
    choices = [f"choice {i} " + "c" * 400 for i in range(2001)]
    body = {"model": system.model, "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 4,
            "guided_choice": choices}

    async def scenario() -> tuple[tuple[int, str | None], httpx.Response]:
        async with httpx.AsyncClient(base_url=system.base_url, timeout=300) as http:
            stream = asyncio.create_task(_stream(http, system.model))
            refused = await http.post("/v1/chat/completions", json=body)
            return await stream, refused

    started = datetime.now(UTC)
    (tokens, finish), refused = asyncio.run(scenario())
    assert refused.status_code in (400, 413, 500), refused.text
    assert (tokens, finish) == (STREAM_TOKENS, "length")
    assert system.worker.process.poll() is None
    assert not any("closed by the server" in line.get("event", "") for line in system.worker.lines)
    if refused.status_code == 500:  # the worker failed it: its run is recorded, the error bounded
        async def error() -> str | None:
            conn = await asyncpg.connect(system.database_url)
            try:
                return await conn.fetchval("SELECT error FROM runs WHERE finished_at >= $1 AND status = 'error' "
                                           "AND error LIKE 'structured output failed%'", started)
            finally:
                await conn.close()

        recorded = eventually(lambda: asyncio.run(error()), 60, message="the failed run recorded")
        assert len(recorded.encode()) <= 1024 and "\n" not in recorded and "<state>" not in recorded
    # And the worker still serves.
    again = httpx.post(f"{system.base_url}/v1/chat/completions", timeout=300, json={
        "model": system.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert again.status_code == 200, again.text

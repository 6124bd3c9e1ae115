"""Any prompt that fits the model's context travels, whatever the server's max_payload: a 3 MiB
prompt through a NATS server left at its default 1 MiB goes through the Object Store, end to end,
and leaves no object behind; through the embedded server (8 MiB) it is one message; a body over
the HTTP limit is a 413 naming the limit at once."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from apps.bus import connection, topology
from apps.embedded.nats_server import NatsServer
from tests.fleet.conftest import own_fleet
from tests.support import eventually

MODEL = "large-prompt-model"
SENTENCE = "The quick brown fox jumps over the lazy dog. "


@pytest.fixture(scope="module", params=["default-1-MiB", "embedded-8-MiB"])
def small_bus(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """A NATS server with nats-server's default max_payload (the Object Store path) or the embedded
    one's, a gateway and a scripted worker whose context holds the whole prompt (this is about the
    bus, not the context); yields (base URL, NATS URL)."""
    folder = tmp_path_factory.mktemp("large")
    default_payload = request.param == "default-1-MiB"
    server = NatsServer(folder / "nats", max_payload=None) if default_payload else NatsServer(folder / "nats")
    with server, own_fleet(server, folder, MODEL, {"default": "read it all"}, ["large-a"],
                           HELEXA_REQUEST_ACK_WAIT_S="30", HELEXA_MAX_MODEL_LEN="4000000") as (base_url, _):
        yield base_url, server.url_for("operator")


async def _objects(nats_url: str) -> list[str]:
    nc = await connection.connect(nats_url, "test-objects")
    try:
        store = await nc.jetstream().object_store(topology.LARGE_REQUESTS_BUCKET)
        try:
            return [info.name for info in await store.list() if not info.deleted]
        except Exception as exc:  # nats-py raises NotFoundError for an empty bucket
            if type(exc).__name__ == "NotFoundError":
                return []
            raise
    finally:
        await nc.close()


def test_a_3_mib_prompt_is_served_end_to_end(small_bus: tuple[str, str]) -> None:
    base_url, nats_url = small_bus
    content = SENTENCE * ((3 << 20) // len(SENTENCE))
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    completion = answer.json()
    assert completion["choices"][0]["message"]["content"] == "read it all"
    assert completion["usage"]["prompt_tokens"] > 500_000
    # The worker deletes the object once it has settled the message (just after the answer).
    eventually(lambda: asyncio.run(_objects(nats_url)) == [], timeout_s=30, message="the request's object is left")


def test_a_body_over_the_http_limit_is_a_413_naming_it(small_bus: tuple[str, str]) -> None:
    base_url, _ = small_bus
    content = "x" * (9 << 20)
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    answer = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)
    assert answer.status_code == 413 and "Retry-After" not in answer.headers
    error = answer.json()["error"]
    assert error["code"] == "request_too_large" and "HELEXA_MAX_REQUEST_BYTES" in error["message"]
    assert str(8 << 20) in error["message"]

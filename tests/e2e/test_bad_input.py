"""Bad input gets a clear OpenAI error envelope with the right status, and no internals."""

from __future__ import annotations

import asyncio
import socket

import asyncpg
import httpx
import pytest

from apps.bus import connection, topology
from tests.e2e.conftest import System
from tests.support import eventually_async

CHAT = "/v1/chat/completions"


def post(system: System, body: bytes | dict, path: str = CHAT) -> httpx.Response:
    with httpx.Client(base_url=system.base_url, timeout=60) as http:
        if isinstance(body, bytes):
            return http.post(path, content=body, headers={"Content-Type": "application/json"})
        return http.post(path, json=body)


def assert_envelope(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    for leak in ("Traceback", "File \"", "nats", "msgspec", "asyncpg", "Exception"):
        assert leak not in response.text
    return error


def test_malformed_json_is_400(system: System) -> None:
    error = assert_envelope(post(system, b'{"model": "x", "messages": ['), 400)
    assert error["code"] == "invalid_json"


def test_missing_messages_is_400_naming_it(system: System) -> None:
    error = assert_envelope(post(system, {"model": system.model}), 400)
    assert error["param"] == "messages"


@pytest.mark.parametrize(
    "field, value",
    [("temperature", -1), ("temperature", "hot"), ("max_tokens", 0), ("top_p", 1.5), ("n", 0), ("n", 17)],
    ids=["negative-temperature", "string-temperature", "zero-max-tokens", "top-p-above-1", "n-0", "n-17"],
)
def test_invalid_parameter_is_400_naming_it(system: System, field: str, value: object) -> None:
    body = {"model": system.model, "messages": [{"role": "user", "content": "hi"}], field: value}
    error = assert_envelope(post(system, body), 400)
    assert error["param"] == field


def test_unknown_model_is_404_naming_the_models_served(system: System) -> None:
    body = {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}
    error = assert_envelope(post(system, body), 404)
    assert error["code"] == "model_not_found"
    assert error["param"] == "model"
    assert f"Served here: '{system.model}'" in error["message"]


def test_known_model_without_worker_is_503_with_retry_after(system: System) -> None:
    async def remember_model() -> None:
        # A worker once served this model (its durable consumer exists) but none is live now.
        nc = await connection.connect(system.nats_url, name="test")
        js = nc.jetstream()
        await js.add_consumer(topology.REQUESTS_STREAM, config=topology.worker_consumer_config("offline-model"))
        await nc.close()

    asyncio.run(remember_model())
    body = {"model": "offline-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    response = post(system, body)
    error = assert_envelope(response, 503)
    assert int(response.headers["Retry-After"]) >= 1
    assert error["code"] == "model_unavailable"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_prompt_over_the_context_is_400_before_generation(system: System, stream: bool) -> None:
    body = {"model": system.model, "messages": [{"role": "user", "content": "context test" + " word" * 9000}],
            "stream": stream}
    response = post(system, body)
    error = assert_envelope(response, 400)
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("This model's maximum context length is 8192 tokens. However, you requested")
    # The refusal names its request, which is this test's own row in the ledger.
    request_id = response.headers["X-Request-Id"]

    async def ledger() -> asyncpg.Record:
        conn = await asyncpg.connect(system.database_url)
        try:
            return await eventually_async(lambda: conn.fetchrow(
                "SELECT r.request_id, r.status, r.error, r.prompt_tokens, r.started_at, "
                "(SELECT count(*) FROM events e "
                "WHERE e.kind = 'run.started' AND e.payload->>'request_id' = r.request_id) AS starts "
                "FROM runs r WHERE r.request_id = $1", request_id),
                30, message="the rejection never reached the ledger")
        finally:
            await conn.close()

    row = asyncio.run(ledger())
    assert row["error"] == "context_length_exceeded" and row["prompt_tokens"] > 8192
    assert row["status"] == "rejected" and row["started_at"] is None and row["starts"] == 0


def test_unknown_route_is_404_envelope(system: System) -> None:
    with httpx.Client(base_url=system.base_url, timeout=30) as http:
        assert_envelope(http.get("/v1/nothing-here"), 404)


def test_oversized_body_is_413(system: System) -> None:
    body = {"model": system.model, "messages": [{"role": "user", "content": "x" * (9 << 20)}]}
    assert_envelope(post(system, body), 413)


def test_each_failure_logs_one_structured_warning(system: System) -> None:
    body = {"model": "model-for-the-log-test", "messages": [{"role": "user", "content": "hi"}]}
    assert_envelope(post(system, body), 404)
    entry = system.gateway.wait_for(
        lambda e: e.get("event") == "request failed" and e.get("model") == "model-for-the-log-test", timeout_s=10
    )
    assert {"handler", "model", "node", "request_id", "status", "error"} <= set(entry)
    assert entry["status"] == 404 and entry["level"] == "warning"
    matching = [e for e in system.gateway.lines
                if e.get("event") == "request failed" and e.get("model") == "model-for-the-log-test"]
    assert len(matching) == 1


def test_a_client_that_leaves_while_its_body_is_read_is_logged_as_leaving_not_as_a_server_error(
        system: System) -> None:
    host, port = system.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n".encode() + b'{"model": "x')
    entry = system.gateway.wait_for(lambda e: e.get("event") == "request failed"
                                    and e.get("error") == "the client left while its body was read", timeout_s=30)
    assert entry["status"] == 499

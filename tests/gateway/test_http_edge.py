"""The HTTP edge below the app (apps/gateway/http_edge.py), on real sockets against uvicorn with
the gateway's protocol and a small echo app: header count and bytes (431), header and body read
time (408), the connection cap (503), and that none of it touches a well-behaved request, a
keep-alive connection's next request, or an answer that takes longer than every timeout; and
that the server (`EdgeServer`, whose loop ticks once a second) dates its answers and stops when told."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from collections.abc import AsyncIterator

import pytest
import uvicorn

from apps.embedded import free_port
from apps.gateway import http_edge
from apps.gateway.http_edge import EdgeLimits, EdgeServer, protocol_class
from tests.support import eventually_async

LIMITS = EdgeLimits(max_connections=8, max_headers=20, max_header_bytes=4096, header_timeout_s=0.5,
                    body_timeout_s=0.5)


async def echo(scope: dict, receive, send) -> None:  # type: ignore[no-untyped-def]
    """Echoes the body; `/slow` answers in ten pieces over 2 s (longer than every timeout)."""
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/slow":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for i in range(10):
            await asyncio.sleep(0.2)
            await send({"type": "http.response.body", "body": b"%d" % i, "more_body": True})
        await send({"type": "http.response.body", "body": b""})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"%d" % len(body))]})
    await send({"type": "http.response.body", "body": body})


@contextlib.asynccontextmanager
async def serving(limits: EdgeLimits) -> AsyncIterator[int]:
    port = free_port()
    server = EdgeServer(uvicorn.Config(echo, host="127.0.0.1", port=port, http=protocol_class(limits),
                                       ws="none", log_config=None))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "the server did not start"
        await asyncio.sleep(0.01)
    try:
        yield port
    finally:
        server.exit()
        await task


@pytest.fixture
async def port() -> AsyncIterator[int]:
    async with serving(LIMITS) as port:
        yield port


async def exchange(port: int, raw: bytes, timeout_s: float = 10.0) -> bytes:
    """Send `raw`, then read until the server closes (or `timeout_s`, which fails the test)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()


def status(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response else 0


def request(path: str = "/", headers: dict[str, str] | None = None, body: bytes = b"") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: test", f"Content-Length: {len(body)}", "Connection: close"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def test_a_request_within_the_limits_is_served(port: int) -> None:
    headers = {f"X-H{i}": "v" for i in range(LIMITS.max_headers - 4)}  # 4 of the request's own
    response = await exchange(port, request(headers=headers, body=b"hello"))
    assert status(response) == 200 and response.endswith(b"hello")


async def test_too_many_header_fields_are_431(port: int) -> None:
    response = await exchange(port, request(headers={f"X-H{i}": "v" for i in range(LIMITS.max_headers)}))
    assert status(response) == 431
    assert "fields" in json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]["message"]


async def test_an_oversized_header_is_cut_off_before_it_is_all_sent(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    sent, response = 0, b""
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: test\r\nX-Big: ")
        with pytest.raises(ConnectionError):  # the server stops reading and closes, mid-header
            while sent < 4 << 20:
                writer.write(b"a" * 8192)
                await writer.drain()
                sent += 8192
        with contextlib.suppress(ConnectionError):  # a close with our bytes unread is a reset
            response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    assert sent < 4 << 20
    assert status(response) in (431, 0)


async def test_an_unfinished_header_block_is_408_after_the_header_timeout(port: int) -> None:
    response = await exchange(port, b"GET / HTTP/1.1\r\nHost: test\r\nX-Slow: ")
    assert status(response) == 408


async def test_a_silent_connection_is_closed_after_the_header_timeout(port: int) -> None:
    assert await exchange(port, b"") == b""


async def test_a_trickled_body_is_408_after_the_body_timeout(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 1000\r\n\r\n")

        async def trickle() -> None:
            while True:
                writer.write(b"x")
                await writer.drain()
                await asyncio.sleep(0.1)

        trickling = asyncio.create_task(trickle())
        response = await asyncio.wait_for(reader.read(), 10)
        trickling.cancel()
        await asyncio.gather(trickling, return_exceptions=True)
    finally:
        writer.close()
    assert status(response) == 408


async def test_keep_alive_requests_and_a_slow_answer_are_untouched(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for body in (b"one", b"two"):
            writer.write(b"POST / HTTP/1.1\r\nHost: test\r\nContent-Length: 3\r\n\r\n" + body)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert status(head) == 200
            assert await asyncio.wait_for(reader.readexactly(3), 10) == body
    finally:
        writer.close()
    # Two seconds of answer, past both timeouts: the timers are for reading, not for answering.
    response = await exchange(port, request("/slow"))
    assert status(response) == 200 and b"9" in response and response.endswith(b"0\r\n\r\n")


async def test_connections_past_the_cap_are_503_and_the_rest_are_served() -> None:
    # Idle connections hold their sockets here for as long as the test needs them.
    limits = dataclasses.replace(LIMITS, header_timeout_s=60.0)
    async with serving(limits) as port:
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(limits.max_connections - 1)]
        try:
            served = await exchange(port, request(body=b"x"))  # the last one under the cap
            assert status(served) == 200
            held.append(await asyncio.open_connection("127.0.0.1", port))
            extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(3)]
            answers = [await asyncio.wait_for(reader.read(), 10) for reader, _ in extra]
            for _, writer in extra:
                writer.close()
            assert [status(a) for a in answers] == [503, 503, 503]
            assert b"retry-after: 1" in answers[0]
            held.pop()[1].close()

            async def served_again() -> bool:  # once the server has seen that close, a socket is free
                return status(await exchange(port, request(body=b"y"))) == 200

            await eventually_async(served_again, 10)
        finally:
            for _, writer in held:
                writer.close()


async def test_answers_are_dated_and_exit_stops_the_server_between_ticks(monkeypatch: pytest.MonkeyPatch) -> None:
    """`EdgeServer` dates its answers; `exit()` ends `serve` without waiting for the next tick: with
    ticks an hour apart, a loop that slept between them would never end here."""
    monkeypatch.setattr(http_edge, "DATE_REFRESH_S", 3600.0)
    port = free_port()
    server = EdgeServer(uvicorn.Config(echo, host="127.0.0.1", port=port, http=protocol_class(LIMITS),
                                       ws="none", log_config=None))
    task = asyncio.create_task(server.serve())
    await eventually_async(lambda: server.started, 30, message="the server did not start")
    answer = await exchange(port, b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 2\r\nconnection: close\r\n\r\nhi")
    assert answer.startswith(b"HTTP/1.1 200") and b"\r\ndate: " in answer.lower()
    server.exit()
    await asyncio.wait_for(task, 30)

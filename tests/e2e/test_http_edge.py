"""The HTTP edge against real gateways (issue 35): slow and oversized clients cost a bounded time
and nothing else (slowloris, a 4 MB header, 100,000 headers, a body trickled a byte every 2 s),
the Host check of a keyless loopback gateway (DNS rebinding), per-principal request rates, and
admission of the token routes and of stored responses read or deleted. Each runs beside a normal
request or stream that must still be answered in full."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import httpx
import pytest

from apps.embedded import free_port
from tests.e2e.conftest import System
from tests.support import AppProcess, eventually_async

TIMEOUT_S = 3.0  # the header and body timeouts of this module's own gateway
HALF_OPEN = 500
STREAM_TOKENS = 48


@contextlib.contextmanager
def gateway(system: System, **env: str) -> Iterator[tuple[str, int]]:
    port = free_port()
    process = AppProcess(["gateway"], {"NATS_URL": system.nats_url, "DATABASE_URL": system.database_url,
                                       "HELEXA_PORT": str(port), **env})
    try:
        process.wait_ready()
        yield f"http://127.0.0.1:{port}", port
    finally:
        process.stop()


@pytest.fixture(scope="module")
def short_timeouts(system: System) -> Iterator[tuple[str, int]]:
    with gateway(system, HELEXA_HEADER_TIMEOUT_S=str(TIMEOUT_S), HELEXA_BODY_TIMEOUT_S=str(TIMEOUT_S)) as gw:
        yield gw


def chat(model: str, max_tokens: int = 4, stream: bool = False) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": "Tell me about the sea."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            **({"stream_options": {"include_usage": True}} if stream else {})}


class Beside:
    """A normal stream that runs while a test attacks: `result()` is its completion token count
    once it has finished, and the error events it had."""

    def __init__(self, base_url: str, model: str, headers: dict[str, str] | None = None) -> None:
        self.out: dict = {}
        self.first_text = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base_url, model, headers or {}))
        self._thread.start()
        assert self.first_text.wait(300), f"the stream beside never produced text: {self.out}"

    def _run(self, base_url: str, model: str, headers: dict[str, str]) -> None:
        usage, errors = None, []
        try:
            with httpx.Client(base_url=base_url, timeout=600, headers=headers) as http:
                with http.stream("POST", "/v1/chat/completions", json=chat(model, STREAM_TOKENS, True)) as response:
                    for line in response.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        errors += [chunk["error"]] if "error" in chunk else []
                        if any(c["delta"].get("content") for c in chunk.get("choices", [])):
                            self.first_text.set()
                        usage = chunk.get("usage") or usage
        finally:
            self.out.update(usage=usage, errors=errors)
            self.first_text.set()

    def result(self) -> tuple[int | None, list]:
        self._thread.join(600)
        usage = self.out.get("usage")
        return (usage or {}).get("completion_tokens"), self.out.get("errors")


def read_until_closed(sock: socket.socket, timeout_s: float) -> bytes:
    sock.settimeout(timeout_s)
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := sock.recv(65536):
            data += chunk
    return data


def send_whole_request(port: int, head: bytes, filler: bytes, total: int) -> bytes:
    """Send `head`, `filler` repeated up to `total` bytes and the header block's end, as far as
    the server lets it; what the server answered once it closed. (Loopback buffers take most of
    a megabyte whether the server reads it or not.)"""
    sock = socket.create_connection(("127.0.0.1", port))
    try:
        with contextlib.suppress(ConnectionError):
            sock.sendall(head)
            for _ in range(total // len(filler)):
                sock.sendall(filler)
            sock.sendall(b"\r\n")
        return read_until_closed(sock, 30)
    finally:
        sock.close()


def test_slowloris_half_open_connections_are_closed_and_others_served(system: System,
                                                                       short_timeouts: tuple[str, int]) -> None:
    url, port = short_timeouts
    beside = Beside(url, system.model)
    partial = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nX-Slow: ".encode()
    sockets = [socket.create_connection(("127.0.0.1", port)) for _ in range(HALF_OPEN)]
    try:
        for sock in sockets:
            sock.sendall(partial)
        opened = time.monotonic()
        with httpx.Client(base_url=url, timeout=60) as http:
            # Below the connection cap: served while the half-open ones are still open.
            assert http.get("/health").status_code == 200
            answer = http.post("/v1/chat/completions", json=chat(system.model))
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
            answers = [read_until_closed(sock, 60) for sock in sockets]
            closed_after = time.monotonic() - opened
            assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), {a[:40] for a in answers}
            assert closed_after < 60  # the header timeout (3 s), loosely: not the client's patience
            answer = http.post("/v1/chat/completions", json=chat(system.model))
            assert answer.status_code == 200
    finally:
        for sock in sockets:
            sock.close()
    assert beside.result() == (STREAM_TOKENS, [])


@pytest.mark.parametrize(("head", "filler", "total"), [
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ", b"a" * 65536, 4 << 20),
    (b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n", b"X-H: v\r\n" * 8192, 100_000 * 8),
], ids=["4MB-header", "100k-headers"])
def test_oversized_header_blocks_are_refused(system: System, head: bytes, filler: bytes, total: int) -> None:
    port = int(system.base_url.rsplit(":", 1)[1])
    beside = Beside(system.base_url, system.model)
    answer = send_whole_request(port, head, filler, total)
    # Refused (or cut off: a close with the client's bytes unread is a reset), never served.
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431 "), answer[:80]
    with httpx.Client(base_url=system.base_url, timeout=60) as http:
        assert http.get("/health").status_code == 200
    assert beside.result() == (STREAM_TOKENS, [])


def test_a_body_trickled_a_byte_every_two_seconds_is_cut_off(system: System, short_timeouts: tuple[str, int]) -> None:
    url, port = short_timeouts
    beside = Beside(url, system.model)
    sock = socket.create_connection(("127.0.0.1", port))
    stop = threading.Event()

    def trickle() -> None:
        with contextlib.suppress(OSError):
            while not stop.is_set():
                sock.sendall(b" ")
                stop.wait(2.0)

    try:
        sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                     "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode())
        started = time.monotonic()
        trickler = threading.Thread(target=trickle)
        trickler.start()
        answer = read_until_closed(sock, 120)
        took = time.monotonic() - started
    finally:
        stop.set()
        sock.close()
    trickler.join(10)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:80]
    assert b"body" in answer and took < 60  # cut at the body timeout, loosely; the body needed 2000 s
    assert beside.result() == (STREAM_TOKENS, [])


def test_a_keyless_loopback_gateway_answers_only_loopback_hosts(system: System) -> None:
    port = system.base_url.rsplit(":", 1)[1]
    beside = Beside(system.base_url, system.model)
    with httpx.Client(base_url=system.base_url, timeout=60) as http:
        for host in ("evil.example", f"evil.example:{port}", f"localhost:{int(port) + 1}"):
            refused = http.post("/v1/chat/completions", json=chat(system.model), headers={"Host": host})
            assert refused.status_code == 421, (host, refused.text)
            assert refused.json()["error"]["param"] == "Host"
            assert http.get("/v1/models", headers={"Host": host}).status_code == 421
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            served = http.post("/v1/chat/completions", json=chat(system.model), headers={"Host": host})
            assert served.status_code == 200, (host, served.text)
    assert beside.result() == (STREAM_TOKENS, [])


def test_a_principal_over_its_rate_is_429_and_another_is_not(system: System, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("sk-alice alice\nsk-bob bob\n", encoding="utf-8")
    # One request per 20 s after a burst of 3: nothing here refills in the test's time.
    with gateway(system, HELEXA_API_KEYS=str(keys), HELEXA_RATE_LIMIT_RPS="0.05",
                 HELEXA_RATE_LIMIT_BURST="3") as (url, _):
        beside = Beside(url, system.model, {"Authorization": "Bearer sk-bob"})  # bob's first request
        with httpx.Client(base_url=url, timeout=60) as http:
            alice = {"Authorization": "Bearer sk-alice"}
            assert [http.get("/v1/models", headers=alice).status_code for _ in range(3)] == [200] * 3
            refused = http.post("/v1/chat/completions", json=chat(system.model), headers=alice)
            assert refused.status_code == 429
            assert 1 <= int(refused.headers["Retry-After"]) <= 20
            error = refused.json()["error"]
            assert error["code"] == "rate_limit_exceeded" and "HELEXA_RATE_LIMIT_RPS" in error["message"]
            tokenize = http.post("/tokenize", json={"model": system.model, "prompt": "hi"}, headers=alice)
            assert tokenize.status_code == 429
            bob = http.post("/v1/chat/completions", json=chat(system.model), headers={"Authorization": "Bearer sk-bob"})
            assert bob.status_code == 200, bob.text
            assert http.get("/health").status_code == 200  # not a guarded route: never limited
        assert beside.result() == (STREAM_TOKENS, [])


def test_anonymous_callers_are_limited_per_address(system: System) -> None:
    with gateway(system, HELEXA_RATE_LIMIT_RPS="0.05", HELEXA_RATE_LIMIT_BURST="2") as (url, port):
        beside = Beside(url, system.model)  # 127.0.0.1's first request
        host = {"Host": f"127.0.0.1:{port}"}
        with httpx.Client(base_url=url, timeout=60) as here, \
                httpx.Client(base_url=url, timeout=60, headers=host,
                             transport=httpx.HTTPTransport(local_address="127.0.0.2")) as elsewhere:
            assert here.get("/v1/models").status_code == 200
            refused = here.get("/v1/models")
            assert refused.status_code == 429 and "client address" in refused.json()["error"]["message"]
            assert [elsewhere.get("/v1/models").status_code for _ in range(2)] == [200, 200]
        assert beside.result() == (STREAM_TOKENS, [])


async def _admissions(database_url: str, since: float, kinds: set[str], ids: set[str]) -> dict[str, list]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT detail, decision, request_id, model FROM admission_events "
                                "WHERE ts >= to_timestamp($1) AND detail = ANY($2::text[])", since, list(kinds))
    finally:
        await conn.close()
    found: dict[str, list] = {}
    for row in rows:
        found.setdefault(row["detail"], []).append(dict(row))
    responses_ok = all(any(r["request_id"] in ids for r in found.get(k, [])) for k in kinds if k.startswith("resp"))
    return found if set(found) == kinds and responses_ok else {}


def test_token_routes_and_stored_responses_pass_admission(system: System) -> None:
    since = time.time() - 1
    beside = Beside(system.base_url, system.model)
    unknown = f"resp_{uuid.uuid4().hex}"
    with httpx.Client(base_url=system.base_url, timeout=120) as http:
        tokenized = http.post("/tokenize", json={"model": system.model, "prompt": "Hello there"})
        assert tokenized.status_code == 200, tokenized.text
        assert http.post("/detokenize", json={"model": system.model,
                                              "tokens": tokenized.json()["tokens"]}).status_code == 200
        counted = http.post("/v1/messages/count_tokens", json={
            "model": system.model, "messages": [{"role": "user", "content": "Hello there"}]})
        assert counted.status_code == 200, counted.text
        assert http.get(f"/v1/responses/{unknown}").status_code == 404
        assert http.delete(f"/v1/responses/{unknown}").status_code == 404
    kinds = {"tokenize", "detokenize", "count_tokens", "responses.get", "responses.delete"}
    found = asyncio.run(eventually_async(lambda: _admissions(system.database_url, since, kinds, {unknown[:128]}), 30,
                                         message=lambda: system.recorder.output()))
    assert all(r["decision"] == "admitted" for rows in found.values() for r in rows)
    assert {r["model"] for k in ("tokenize", "detokenize", "count_tokens") for r in found[k]} == {system.model}
    assert beside.result() == (STREAM_TOKENS, [])

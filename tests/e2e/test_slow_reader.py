"""A streaming client that stops reading cannot make the gateway hold its whole answer: past the
bounded per-stream buffer the request is cancelled, and the stream ends with an error event and
`[DONE]` once the client reads again."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from apps.embedded import free_port
from tests.e2e.conftest import System, scripted_worker
from tests.e2e.test_chat import finished_run
from tests.support import AppProcess, eventually

FAST = "slow-reader-fast"
# More than the socket buffers hold, so the gateway's 16-frame buffer must overflow; the worker's context
# is set so that its output limit (a quarter of it, at most 8192) allows that many.
TOKENS = 8000


@pytest.fixture(scope="module")
def fast_model(system: System, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    reply = " ".join(f"w{i}" for i in range(TOKENS))  # no delays: frames come as fast as they can
    with scripted_worker(system, tmp_path_factory.mktemp("script"), FAST, {"rules": [], "default": reply},
                         # Every delta its own frame (no frame window): the frames, not their bytes, fill the buffer.
                         {"HELEXA_MAX_MODEL_LEN": "65536", "HELEXA_FRAME_WINDOW_MS": "0"}):
        yield FAST


def test_a_client_that_stops_reading_is_cancelled_not_buffered(system: System, fast_model: str) -> None:
    port = free_port()
    gateway = AppProcess(["gateway"], {**system.env_for("gateway"), "HELEXA_PORT": str(port),
                                       "HELEXA_STREAM_BUFFER_FRAMES": "16"})
    try:
        gateway.wait_ready()
        url = f"http://127.0.0.1:{port}"
        eventually(lambda: httpx.get(f"{url}/ready").status_code == 200, 30)
        data = json.dumps({"model": fast_model, "messages": [{"role": "user", "content": "Go."}],
                           "max_tokens": TOKENS, "ignore_eos": True, "stream": True}).encode()
        conn = socket.socket()
        # A small receive window, so the socket buffers fill quickly and the gateway's own must take the rest.
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.connect(("127.0.0.1", port))
        try:
            conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n".encode()
                         + b"Content-Type: application/json\r\n"
                         + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
            head = b""
            while b"\r\n\r\n" not in head:
                head += conn.recv(1)
            request_id = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                              if line.lower().startswith(b"x-request-id:"))
            # Not reading any more: the run must end, cancelled, long before its 8000 tokens.
            row = asyncio.run(finished_run(system, request_id, timeout_s=120))
            assert row["status"] == "cancelled" and row["completion_tokens"] < TOKENS
            rest = b""
            while chunk := conn.recv(65536):
                rest += chunk
                if b"data: [DONE]" in rest:
                    break
        finally:
            conn.close()
        # The error event, then the end marker, and nothing generated after the error.
        assert b"client_too_slow" in rest and b"data: [DONE]" in rest
        assert rest.index(b"client_too_slow") < rest.index(b"data: [DONE]")
        assert b'"content"' not in rest[rest.index(b"client_too_slow"):]
        metrics = httpx.get(f"{url}/metrics").text
        assert f'helexa:gateway_slow_reader_cancels_total{{model="{fast_model}"}} 1.0' in metrics
    finally:
        gateway.stop()

"""The HTTP edge below the app: what a connection may cost before any route, key or admission
sees it. uvicorn's own knobs cover the idle keep-alive connection (`timeout_keep_alive`) and little
else, so `protocol_class` is uvicorn's httptools protocol with these bounds added:

- open sockets: past `max_connections` a new one is answered 503 and closed at once, before a
  byte of its request is read (uvicorn's `limit_concurrency` looks only after a whole header
  block, which a slow client never sends, so it bounds nothing here);
- the header block: at most `max_headers` fields and `max_header_bytes` bytes, the request line
  included (431, and the connection closes); the raw bytes of a block still arriving are counted
  as they come, so one huge field is cut off at the limit, not buffered whole first;
- time: a header block must be complete `header_timeout_s` after the connection opens or its
  first byte arrives (408, or a silent close if nothing came); a body must be complete
  `body_timeout_s` after its headers (408, and the app sees the client gone), a file upload
  (`POST /v1/files`, bounded in bytes by its route) `upload_timeout_s` after them;
- no protocol upgrades (`ws="none"`: the gateway has no WebSocket route).

`EdgeServer` is uvicorn's server with a main loop that sleeps a second, not a tenth, between ticks.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from apps.gateway.errors import error_body, log_failure
from apps.settings import GatewaySettings

log = logging.getLogger("helexa.gateway")

# The route whose body is a file upload, given `upload_timeout_s` to arrive.
UPLOAD_PATH = "/v1/files"
# File descriptors beyond the connection cap: NATS, PostgreSQL, logs, the listening socket.
SPARE_FDS = 256
# How often the server's loop wakes to refresh the Date header (which counts in seconds).
DATE_REFRESH_S = 1.0


@dataclass(slots=True, frozen=True)
class EdgeLimits:
    max_connections: int
    max_headers: int
    max_header_bytes: int
    header_timeout_s: float
    body_timeout_s: float
    upload_timeout_s: float = 600.0

    @classmethod
    def of(cls, settings: GatewaySettings) -> EdgeLimits:
        return cls(settings.max_connections, settings.max_headers, settings.max_header_bytes,
                   settings.header_timeout_s, settings.body_timeout_s, settings.upload_timeout_s)


def _response(status: int, reason: str, message: str, setting: str) -> bytes:
    """A whole refusal, written straight to the socket (no app runs for it); `setting` goes to the log."""
    body = json.dumps(error_body(status, message)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n")
    if status == 503:
        head += "retry-after: 1\r\n"
    log_failure("http edge", status, setting)
    return head.encode() + b"\r\n" + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """One connection, as uvicorn's httptools protocol serves it, within `limits`."""

    limits: ClassVar[EdgeLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._in_header_block = False
        self._header_fields = 0
        self._header_bytes = 0  # of the fields and the request line, as parsed
        self._raw_header_bytes = 0  # received while the block is incomplete
        self._received_any = False
        self._refusal: bytes | None = None

    # -- connections ---------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]  # TCP: always one
        super().connection_made(transport)
        if len(self.connections) > self.limits.max_connections:
            self._close_with(_response(503, "Service Unavailable",
                                       "Too many open connections to this server; retry shortly.",
                                       "HELEXA_MAX_CONNECTIONS"))
            return
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel(self._header_timer)
        self._cancel(self._body_timer)
        self._header_timer = self._body_timer = None
        super().connection_lost(exc)

    def _close_with(self, response: bytes) -> None:
        """Answer `response` and close; only close where an answer is already being written
        (a refusal cannot be put in the middle of it)."""
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if cycle is not None and cycle.response_started and not cycle.response_complete:
            self.transport.close()
            return
        if cycle is not None and not cycle.response_started:
            cycle.disconnected = True  # the app's answer, if it comes, goes nowhere
        self.transport.write(response)
        self.transport.close()

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()

    # -- the header block ----------------------------------------------------------------------

    def _arm_header_timer(self) -> None:
        self._cancel(self._header_timer)
        self._header_timer = self.loop.call_later(self.limits.header_timeout_s, self._header_timed_out)

    def _header_timed_out(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if not self._received_any:
            self.transport.close()  # a connection that never said anything: nobody to answer
            return
        self._close_with(_response(408, "Request Timeout", "The request headers took too long to arrive.",
                                   "HELEXA_HEADER_TIMEOUT_S"))

    def data_received(self, data: bytes) -> None:
        """uvicorn's, but a header block over the limits is answered 431 rather than logged and
        answered as a malformed request."""
        if self.transport.is_closing():
            return  # refused or timed out: nothing more is parsed
        self._received_any = True
        self._unset_keepalive_if_required()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._unsupported_upgrade_warning()
        except httptools.HttpParserError:
            refusal, self._refusal = self._refusal, None
            if refusal is None:
                log.warning("invalid HTTP request received")
                self.send_400_response("Invalid HTTP request received.")
            else:
                self._close_with(refusal)
            return
        if self._in_header_block and not self.transport.is_closing():
            self._raw_header_bytes += len(data)
            if self._raw_header_bytes > self.limits.max_header_bytes:
                self._refuse_headers()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_header_block = True
        self._header_fields = 0
        self._header_bytes = 0
        self._raw_header_bytes = 0
        if self._header_timer is None:  # a keep-alive connection's next request
            self._arm_header_timer()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_fields += 1
        self._count_header_bytes(len(name) + len(value) + 4)
        super().on_header(name, value)

    def _count_header_bytes(self, size: int) -> None:
        self._header_bytes += size
        if self._header_fields > self.limits.max_headers or self._header_bytes > self.limits.max_header_bytes:
            # Raised inside the parser's callback, it stops the parser: `data_received` answers.
            self._refusal = self._too_large()
            raise ValueError("request header block over the limit")

    def _too_large(self) -> bytes:
        limits = self.limits
        return _response(431, "Request Header Fields Too Large",
                         f"The request headers are over this server's limit of {limits.max_headers} fields "
                         f"or {limits.max_header_bytes} bytes.", "HELEXA_MAX_HEADERS/HELEXA_MAX_HEADER_BYTES")

    def _refuse_headers(self) -> None:
        self._close_with(self._too_large())

    def on_headers_complete(self) -> None:
        self._in_header_block = False
        self._cancel(self._header_timer)
        self._header_timer = None
        super().on_headers_complete()
        self._cancel(self._body_timer)
        timeout = self.limits.body_timeout_s
        if self.scope.get("method") == "POST" and self.scope.get("path") == UPLOAD_PATH:
            timeout = self.limits.upload_timeout_s
        self._body_timer = self.loop.call_later(timeout, self._body_timed_out)

    # -- the body ------------------------------------------------------------------------------

    def on_message_complete(self) -> None:
        self._cancel(self._body_timer)
        self._body_timer = None
        super().on_message_complete()

    def _body_timed_out(self) -> None:
        self._body_timer = None
        if self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.response_complete:
            self.transport.close()  # answered already (e.g. a 413): the rest of the body is not wanted
            return
        self._close_with(_response(408, "Request Timeout", "The request body took too long to arrive.",
                                   "HELEXA_BODY_TIMEOUT_S"))


def protocol_class(limits: EdgeLimits) -> type[GuardedHttpToolsProtocol]:
    """The protocol uvicorn runs for each connection, bound to `limits`."""
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), {"limits": limits})


def raise_fd_limit(max_connections: int) -> None:
    """Let the process hold `max_connections` sockets and its own files (the soft limit up to the
    hard one): past the soft limit `accept` fails, and every new client with it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + SPARE_FDS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        new = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        if new < wanted:
            log.warning("the open-file limit is below the connection cap",
                        extra={"nofile": new, "max_connections": max_connections})


class EdgeServer(uvicorn.Server):
    """uvicorn's server, woken once a second while it serves instead of ten times.

    uvicorn's main loop ticks every 0.1 s only to refresh the Date header (once a second, its
    resolution) and to look at `should_exit`: ~1 ms of CPU a second on an idle gateway. Here
    each tick refreshes the header, and `exit()` ends the loop at once rather than at a tick."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exiting = asyncio.Event()

    def exit(self) -> None:
        self.should_exit = True
        self._exiting.set()

    async def main_loop(self) -> None:
        while not await self.on_tick(0):  # tick 0: the Date header is refreshed
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exiting.wait(), DATE_REFRESH_S)

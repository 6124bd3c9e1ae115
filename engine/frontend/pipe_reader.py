"""The engine core's messages, read on the worker's event loop as they arrive, never blocking it.

The core writes each message with `Connection.send_bytes` (`engine.core.core_process`): a 4-byte
big-endian signed length, or -1 and an 8-byte length for a message over 2 GiB, then the bytes. A
thread blocked in `recv_bytes` handed every message to the loop with `call_soon_threadsafe`: two
threads taking the GIL in turn and a wake-up pipe written for each of the core's steps, ~0.6 ms
of the worker's CPU per 64-token request at 16 streams. Here the loop watches the socket itself
(`add_reader`): when it is readable, what is there is read without waiting (`MSG_DONTWAIT`, on
this call only: the writer thread's sends on the same socket stay blocking), every whole message
in it is handed on in order, and a message still arriving waits in the buffer for the rest.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from multiprocessing.connection import Connection

# Read at most this much per wake-up: a large message arrives over several, the loop runs between.
READ_BYTES = 1 << 18
_SHORT_HEADER = 4
_LONG_HEADER = _SHORT_HEADER + 8


class PipeReader:
    """Hands each message the core sends on `conn` to `on_message` (on the loop, in order), and
    calls `on_closed` once when the core's end is gone. `stop` ends the watch."""

    def __init__(self, loop: asyncio.AbstractEventLoop, conn: Connection,
                 on_message: Callable[[bytes | memoryview], None], on_closed: Callable[[], None]) -> None:
        self._loop = loop
        # A socket of our own on the connection's socket: closing it leaves `conn` open.
        self._sock: socket.socket | None = socket.socket(fileno=os.dup(conn.fileno()))
        self._on_message = on_message
        self._on_closed = on_closed
        self._buffer = bytearray()
        # Bytes the buffer needs before the message at its head is whole.
        self._wanted = _SHORT_HEADER
        loop.add_reader(self._sock.fileno(), self._readable)

    def stop(self) -> None:
        if self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _readable(self) -> None:
        assert self._sock is not None
        try:
            data = self._sock.recv(READ_BYTES, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self.stop()
            self._on_closed()
            return
        if not self._buffer:  # most reads: whole messages, nothing left from before
            view = memoryview(data)
            taken = self._hand_on(view, copy=False)
            self._buffer += view[taken:]
            return
        self._buffer += data
        if len(self._buffer) < self._wanted:  # the message at the head is still arriving
            return
        with memoryview(self._buffer) as view:
            taken = self._hand_on(view, copy=True)
        del self._buffer[:taken]

    def _hand_on(self, view: memoryview, copy: bool) -> int:
        """Hand on every whole message at the start of `view` (as copies when `view` is of the
        buffer, which must not stay exported); returns how many bytes they took, and sets
        `_wanted` to the length the one after them needs to be whole (as far as it is known)."""
        at, end = 0, len(view)
        while True:
            self._wanted = _SHORT_HEADER
            if end - at < _SHORT_HEADER:
                return at
            size = int.from_bytes(view[at:at + _SHORT_HEADER], "big", signed=True)
            header = _SHORT_HEADER
            if size == -1:
                self._wanted = _LONG_HEADER
                if end - at < _LONG_HEADER:
                    return at
                size = int.from_bytes(view[at + _SHORT_HEADER:at + _LONG_HEADER], "big")
                header = _LONG_HEADER
            self._wanted = header + size
            if end - at < self._wanted:
                return at
            body = view[at + header:at + header + size]
            self._on_message(bytes(body) if copy else body)
            at += header + size
            if self._sock is None:  # stopped by the message's handler: the rest is not read
                return at

"""The core's messages read on the event loop (engine/frontend/pipe_reader.py) from a real
multiprocessing pipe, as the core writes them (`Connection.send_bytes`): every message whole and in
order whatever its size and however the reads split it, a half-written message never holding up
the loop, and the core's end closing reported once."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import struct
import threading

from engine.frontend.pipe_reader import PipeReader


class Received:
    def __init__(self) -> None:
        self.messages: list[bytes] = []
        self.closed = 0
        self.arrived = asyncio.Event()

    def message(self, data: bytes | memoryview) -> None:
        self.messages.append(bytes(data))
        self.arrived.set()

    def close(self) -> None:
        self.closed += 1
        self.arrived.set()

    async def until(self, count: int) -> None:
        while len(self.messages) < count:
            self.arrived.clear()
            await asyncio.wait_for(self.arrived.wait(), 30)


async def test_messages_of_every_size_arrive_whole_and_in_order_then_the_close() -> None:
    worker_end, core_end = multiprocessing.Pipe(duplex=True)
    received = Received()
    reader = PipeReader(asyncio.get_running_loop(), worker_end, received.message, received.close)
    # Empty, tiny, at and past send_bytes' 16 KiB split, larger than the pipe, larger than one read.
    sizes = [0, 1, 100, 16_384, 16_385, 70_000, 300_000, 3 << 20, 5]
    sent = [bytes([i % 251]) * size for i, size in enumerate(sizes)]

    def core() -> None:
        for data in sent:
            core_end.send_bytes(data)

    thread = threading.Thread(target=core)
    thread.start()
    await received.until(len(sent))
    await asyncio.to_thread(thread.join)
    assert received.messages == sent
    core_end.close()
    while not received.closed:
        received.arrived.clear()
        await asyncio.wait_for(received.arrived.wait(), 30)
    assert received.closed == 1
    reader.stop()  # stopping again is a no-op
    worker_end.close()


async def test_a_message_half_written_waits_for_its_rest_while_the_loop_runs() -> None:
    worker_end, core_end = multiprocessing.Pipe(duplex=True)
    received = Received()
    reader = PipeReader(asyncio.get_running_loop(), worker_end, received.message, received.close)
    whole = struct.pack("!i", 3) + b"abc"
    body = b"x" * 50_000
    half = struct.pack("!i", len(body)) + body[:20_000]
    os.write(core_end.fileno(), whole + half)  # one whole message, then half of the next
    await received.until(1)
    # The loop goes on (a blocking read would hang here) and nothing half-read is handed on.
    for _ in range(20):
        await asyncio.sleep(0)
    assert received.messages == [b"abc"]
    # The long form of the header (-1, then 8 bytes), which send_bytes uses past 2 GiB.
    os.write(core_end.fileno(), body[20_000:] + struct.pack("!i", -1) + struct.pack("!Q", 2) + b"ok")
    await received.until(3)
    assert received.messages == [b"abc", body, b"ok"]
    reader.stop()
    worker_end.close()
    core_end.close()
    assert received.closed == 0  # a reader stopped by its owner reports no close

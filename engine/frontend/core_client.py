"""The engine as the worker sees it: an `Engine` whose core runs in its own process.

Typed messages (`engine.frontend.protocol`, msgpack) go down a pipe through a writer thread, so a request
of megabytes, or a core busy in a long step that leaves the pipe full, never blocks the event loop
(its heartbeats and acks); what the core sends is read on the loop itself (`pipe_reader`), each step's
outputs handed to the requests' queues.
When a consumer falls behind, its queued outputs are merged into one (coalescing), so a slow client
costs one bigger delta rather than a backlog.
This module imports no torch: the core process (`engine.core.core_process.run_core_process`) does.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from engine.frontend import parent_death
from engine.frontend.engine_config import EngineConfig
from engine.frontend.pipe_reader import PipeReader
from engine.frontend.protocol import (
    ENGINE_STOPPED,
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreInfo,
    CoreReady,
    CoreStats,
    EngineOutput,
    EngineRefused,
    EngineRequest,
    FinishReason,
    ServiceClass,
    Shutdown,
    StepOutputs,
    ToCore,
    encode_message,
    from_core_decoder,
    is_device_fault,
)

log = logging.getLogger("helexa.engine")


class AsyncEngine:
    """Implements `engine.frontend.protocol.Engine`; `await AsyncEngine.start(config)` to get one."""

    def __init__(self, config: EngineConfig, process_setup: Callable[[], None] | None = None) -> None:
        self.config = config
        self.process_setup = process_setup
        self._info: CoreInfo | None = None
        self._stats = CoreStats()
        self._queues: dict[str, OutputQueue] = {}
        # The batch-class requests among them.
        self._batch: set[str] = set()
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Connection | None = None
        # Reads what the core sends, on the loop (None until the core has started).
        self._reader: PipeReader | None = None
        self._process: Any = None
        self._closed = False
        # Encoded messages for the core, in order; None stops the writer thread.
        self._outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        # Called on the event loop when the core process dies unasked, with how many requests it
        # held, once each has had its error output (the worker restarts it: `apps.worker.restarts`).
        self.on_death: Callable[[int], None] | None = None
        # The first device fault the core reported, if any: a core that dies after one is not
        # restarted (the model is poisoned until it is reloaded).
        self.device_fault: str | None = None
        # The requests the core has not finished, and when it was last heard from (or given work
        # while it had none): silence past `config.stall_s` with any of them is a hung core.
        self._unfinished: set[str] = set()
        self._heard_at = time.monotonic()
        self._watchdog: asyncio.Task[None] | None = None
        self.stalled = False

    @classmethod
    async def start(cls, config: EngineConfig, process_setup: Callable[[], None] | None = None) -> AsyncEngine:
        """Start a core for `config`. `process_setup` (picklable: a module-level function or a
        partial of one) runs first in the core's process: the worker sets up its logging there, so
        what the core says while it starts (kernel build, dtype, weights) reaches the worker's log.
        Raises `EngineRefused` where the core refuses the configuration on this machine."""
        engine = cls(config, process_setup)
        try:
            await engine._spawn()
        except asyncio.CancelledError:
            # A start given up on (the worker stops, the model is unloaded) leaves no core behind.
            if engine._process is not None and engine._process.is_alive():
                engine._process.kill()
            raise
        return engine

    async def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        # Named by string: importing engine.core.engine_core here would import torch into the worker.
        self._process = ctx.Process(target=_core_entry, args=(child, self.config, self.process_setup, os.getpid()),
                                    daemon=True,
                                    name="helexa-engine-core")
        self._process.start()
        child.close()
        self._conn = parent
        message = await asyncio.to_thread(self._recv_startup)
        if not isinstance(message, CoreReady):
            self._process.join(5)
            if message.refused:
                raise EngineRefused(message.error)
            raise RuntimeError(f"engine core failed to start: {message.error}")
        self._attach(parent, message.info)

    def _attach(self, conn: Connection, info: CoreInfo) -> None:
        """Talk to a started core over `conn`: its reader and writer threads start here."""
        self._conn = conn
        self._info = info
        self._stats = CoreStats(num_blocks=info.num_blocks, num_free_blocks=info.num_blocks)
        self._loop = asyncio.get_running_loop()
        self._reader = PipeReader(self._loop, conn, self._received, self._core_died)
        threading.Thread(target=self._write, daemon=True, name="helexa-engine-writer").start()
        if self.config.stall_s > 0:
            self._watchdog = asyncio.create_task(self._watch_for_stalls(self.config.stall_s))

    async def _watch_for_stalls(self, stall_s: float) -> None:
        """Kills a core that holds unfinished requests and has been silent for `stall_s` (alive,
        so its pipe never closes, and its requests would wait forever): its death then takes the
        path of any core's, error outputs and a restart."""
        while not self._dead:
            silent_s = time.monotonic() - self._heard_at
            if self._unfinished and silent_s >= stall_s:
                log.error("engine core stalled: not heard from while it held unfinished requests; killed",
                          extra={"pid": self.pid, "silent_s": round(silent_s, 1),
                                 "requests": len(self._unfinished)})
                self.stalled = True
                self._process.kill()
                return
            await asyncio.sleep(max(stall_s - silent_s, 0.0) if self._unfinished else stall_s / 4)

    def _recv_startup(self) -> CoreReady | CoreFailed:
        assert self._conn is not None
        try:
            message = from_core_decoder.decode(self._conn.recv_bytes())
        except EOFError:
            return CoreFailed(error=f"engine core exited with code {self._process.exitcode}")
        assert isinstance(message, CoreReady | CoreFailed)
        return message

    @property
    def info(self) -> CoreInfo:
        assert self._info is not None, "the engine has not started"
        return self._info

    @property
    def stats(self) -> CoreStats:
        return self._stats

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def exitcode(self) -> int | None:
        """The core process's exit code once it has ended and been joined (negative: a signal)."""
        return self._process.exitcode if self._process is not None else None

    @property
    def model_id(self) -> str:
        return self.info.model_id

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def max_num_seqs(self) -> int:
        return self.info.max_num_seqs

    def free_slots(self, service_class: ServiceClass = ServiceClass.INTERACTIVE) -> int:
        if self._dead:
            return 0
        taken = len(self._queues)
        if service_class == ServiceClass.INTERACTIVE:
            taken -= len(self._batch)  # the scheduler preempts batch sequences for interactive ones
        return max(self.max_num_seqs - taken, 0)

    def _received(self, data: bytes | memoryview) -> None:
        self._heard_at = time.monotonic()
        message = from_core_decoder.decode(data)
        if isinstance(message, StepOutputs):
            self._dispatch(message)

    def _dispatch(self, message: StepOutputs) -> None:
        self._stats = message.stats
        for output in message.outputs:
            if output.error is not None and self.device_fault is None and is_device_fault(output.error):
                self.device_fault = output.error
            if output.finished:
                self._unfinished.discard(output.request_id)
            queue = self._queues.get(output.request_id)
            if queue is not None:
                queue.put_nowait(output)

    def _core_died(self) -> None:
        if self._dead:
            return
        self._dead = ENGINE_STOPPED
        if self._closed:
            return  # we asked it to stop: its pipe closing is the expected end
        log.error("engine core process died", extra={"exitcode": self._process.exitcode})
        for request_id, outputs in self._queues.items():
            outputs.put_nowait(EngineOutput(request_id=request_id, new_token_ids=[], finished=True,
                                          finish_reason=FinishReason.ERROR, error=self._dead))
        if self.on_death is not None:
            self.on_death(len(self._queues))

    def _write(self) -> None:
        """The writer thread: sends what `_send` queued, in order, blocking here (never on the
        loop) while the core is busy and the pipe is full."""
        assert self._conn is not None and self._loop is not None
        while (data := self._outbox.get()) is not None:
            try:
                self._conn.send_bytes(data)
            except (OSError, ValueError):
                self._loop.call_soon_threadsafe(self._core_died)
                return

    def _send(self, message: ToCore) -> None:
        """Queue a message for the core; it never waits for the pipe."""
        if self._dead or self._conn is None:
            return
        self._outbox.put(encode_message(message))

    def generate(self, request: EngineRequest) -> OutputStream:
        """Send `request` to the core now, before anything awaits; its outputs come through the
        returned stream."""
        queue = OutputQueue()
        refused = self._dead
        if refused is None and request.request_id in self._queues:
            # Outputs are routed by id: a second stream under a live id would steal the first's.
            refused = f"duplicate request id {request.request_id!r}: a request with that id is running"
        if refused is not None:
            queue.put_nowait(EngineOutput(request_id=request.request_id, new_token_ids=[], finished=True,
                                          finish_reason=FinishReason.ERROR, error=refused))
            return OutputStream(queue, lambda finished: None)
        self._queues[request.request_id] = queue
        if not self._unfinished:
            self._heard_at = time.monotonic()  # silence while it had nothing to do is not a stall
        self._unfinished.add(request.request_id)
        if request.service_class == ServiceClass.BATCH:
            self._batch.add(request.request_id)
        self._send(AddRequest(request))
        return OutputStream(queue, lambda finished: self._release(request.request_id, finished))

    def _release(self, request_id: str, finished: bool) -> None:
        if not finished:
            self._send(AbortRequests([request_id]))
        self._queues.pop(request_id, None)
        self._batch.discard(request_id)
        self._unfinished.discard(request_id)

    async def abort(self, request_id: str) -> None:
        if request_id in self._queues:
            self._send(AbortRequests([request_id]))

    async def shutdown(self) -> None:
        """Stop the core process; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        if self._watchdog is not None:
            self._watchdog.cancel()
        self._send(Shutdown())
        self._outbox.put(None)
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        if self._reader is not None:
            self._reader.stop()
        if self._conn is not None:
            self._conn.close()


class OutputQueue:
    """One request's outputs from the core: put by the dispatcher (on the loop), taken by its
    stream. An unbounded FIFO with one reader, which is all it needs of asyncio.Queue at a
    fraction of the cost per output (one per token of every running request). The reader takes
    what is queued straight from `items` and awaits `wait` only when nothing is `ready`.

    While `held`, outputs queue without waking the reader (a finished one still does): a reader
    that sends text in windows wakes once a window to take them merged, not once a step."""

    __slots__ = ("_waiter", "held", "items")

    def __init__(self) -> None:
        self.items: deque[EngineOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self.held = False

    def put_nowait(self, output: EngineOutput) -> None:
        self.items.append(output)
        if self._waiter is not None and (not self.held or output.finished) and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def ready(self) -> bool:
        """Whether the reader may take outputs now (a finished output is always the last)."""
        items = self.items
        return bool(items) and (not self.held or items[-1].finished)

    def release(self) -> bool:
        """Stop holding; returns whether outputs were queued (the reader wakes for them)."""
        self.held = False
        if not self.items:
            return False
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        return True

    async def wait(self) -> None:
        """Until outputs are `ready`."""
        while not self.ready:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class OutputStream:
    """One request's outputs as the core sends them, the last one `finished`; outputs that queued
    up while the consumer was busy (or `hold` kept) come merged into one. `aclose` before the last
    aborts the request (so does dropping it unclosed); closing twice is closing once."""

    def __init__(self, queue: OutputQueue, release: Callable[[bool], None]) -> None:
        self._queue = queue
        self._release: Callable[[bool], None] | None = release
        self._finished = False

    def __aiter__(self) -> OutputStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self._release is None:  # finished or closed
            raise StopAsyncIteration
        queue = self._queue
        if not queue.ready:
            await queue.wait()
        items = queue.items
        output = items.popleft()
        while items and not output.finished:
            output = output.merged(items.popleft())
        if output.finished:
            self._finished = True
            self._close()
        return output

    def hold(self) -> None:
        """Outputs that do not finish the request wait, without waking this stream's reader, until
        `release`; they then come merged into one."""
        self._queue.held = True

    def release(self) -> bool:
        """End a `hold`; returns whether outputs were waiting (the reader wakes to take them)."""
        return self._queue.release()

    async def aclose(self) -> None:
        self._close()

    def __del__(self) -> None:
        # Dropped unclosed (a loop broken out of): aborted, as an async generator would be.
        self._close()

    def _close(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release(self._finished)


def _core_entry(conn: Connection, config: EngineConfig, process_setup: Callable[[], None] | None,
                worker_pid: int) -> None:
    """The spawned process's target: only here is the torch-side core imported. The core dies with
    its worker: a worker killed while the core loads a model (a minute, unanswered pipe) must not
    leave it running."""
    parent_death.arm(signal.SIGKILL, worker_pid)
    if process_setup is not None:
        process_setup()
    from engine.core.core_process import run_core_process

    run_core_process(conn, config)

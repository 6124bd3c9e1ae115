"""The engine as the worker sees it: an `Engine` whose core runs in its own process.

Requests go down a pipe; a reader thread hands each step's outputs to the request's asyncio
queue. When a consumer falls behind, its queued outputs are merged into one (coalescing), so a
slow client costs one bigger delta rather than a backlog.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import signal
import threading
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection
from typing import Any

from engine.api import ENGINE_STOPPED, EngineOutput, EngineRequest, FinishReason, device_fault_message
from engine.core import CoreInfo, CoreStats
from engine.engine_config import EngineConfig

log = logging.getLogger("helexa.engine")


def run_core_process(conn: Connection, config: EngineConfig) -> None:
    """The core process: load the model, then step whenever there is work, until told to stop."""
    from engine.core import build_core

    # Ctrl-C reaches the whole process group; the worker owns shutdown and stops us through the
    # pipe (or by closing it), so an interrupted terminal does not look like a crashed engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    try:
        core = build_core(config)
    except Exception as exc:  # reported to the parent, which decides what to do
        conn.send(("fatal", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", core.info))
    while True:
        outputs: list[EngineOutput] = []
        try:
            # Block for commands only when idle; otherwise just take what has arrived.
            if not core.has_work():
                conn.poll(None)
            while conn.poll():
                kind, payload = conn.recv()
                if kind == "add":
                    core.add_request(payload)
                elif kind == "abort":
                    outputs.extend(core.abort(payload))
                elif kind == "shutdown":
                    return
        except (EOFError, OSError):
            return  # the worker is gone; so is our reason to run
        try:
            outputs.extend(core.step())
        except Exception as exc:
            log.exception("engine step failed")
            outputs.extend(core.fail_all(device_fault_message(exc)))
        if outputs:
            try:
                conn.send(("outputs", (outputs, core.stats)))
            except (EOFError, OSError):
                return


def merge_outputs(a: EngineOutput, b: EngineOutput) -> EngineOutput:
    """Two consecutive outputs of one request as one."""
    logprobs = None
    if a.logprobs is not None or b.logprobs is not None:
        logprobs = (a.logprobs or []) + (b.logprobs or [])
    return EngineOutput(
        request_id=a.request_id,
        new_token_ids=a.new_token_ids + b.new_token_ids,
        logprobs=logprobs,
        finished=b.finished,
        finish_reason=b.finish_reason,
        num_prompt_tokens=b.num_prompt_tokens or a.num_prompt_tokens,
        num_cached_tokens=max(a.num_cached_tokens, b.num_cached_tokens),
        prefill_ms=a.prefill_ms if a.prefill_ms is not None else b.prefill_ms,
        error=b.error or a.error,
    )


class AsyncEngine:
    """Implements `engine.api.Engine`; `await AsyncEngine.start(config)` to get one."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.info: CoreInfo | None = None
        self.stats = CoreStats()
        self._queues: dict[str, asyncio.Queue[EngineOutput]] = {}
        self._dead: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._conn: Connection | None = None
        self._process: Any = None
        self._closed = False

    @classmethod
    async def start(cls, config: EngineConfig) -> AsyncEngine:
        engine = cls(config)
        await engine._spawn()
        return engine

    async def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=run_core_process, args=(child, self.config), daemon=True,
                                    name="helexa-engine-core")
        self._process.start()
        child.close()
        self._conn = parent
        kind, payload = await asyncio.to_thread(self._recv_startup)
        if kind != "ready":
            self._process.join(5)
            raise RuntimeError(f"engine core failed to start: {payload}")
        self.info = payload
        self.stats = CoreStats(num_blocks=payload.num_blocks, num_free_blocks=payload.num_blocks)
        self._loop = asyncio.get_running_loop()
        threading.Thread(target=self._read, daemon=True, name="helexa-engine-reader").start()

    def _recv_startup(self) -> tuple[str, Any]:
        assert self._conn is not None
        try:
            return self._conn.recv()
        except EOFError:
            return "fatal", f"engine core exited with code {self._process.exitcode}"

    @property
    def model_id(self) -> str:
        assert self.info is not None
        return self.info.model_id

    @property
    def max_model_len(self) -> int:
        assert self.info is not None
        return self.info.max_model_len

    @property
    def max_num_seqs(self) -> int:
        assert self.info is not None
        return self.info.max_num_seqs

    def free_slots(self) -> int:
        if self._dead:
            return 0
        return max(self.max_num_seqs - len(self._queues), 0)

    def _read(self) -> None:
        assert self._conn is not None and self._loop is not None
        while True:
            try:
                kind, payload = self._conn.recv()
            except (EOFError, OSError):
                self._loop.call_soon_threadsafe(self._core_died)
                return
            if kind == "outputs":
                self._loop.call_soon_threadsafe(self._dispatch, *payload)

    def _dispatch(self, outputs: list[EngineOutput], stats: CoreStats) -> None:
        self.stats = stats
        for output in outputs:
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
        for request_id, queue in self._queues.items():
            queue.put_nowait(EngineOutput(request_id=request_id, new_token_ids=[], finished=True,
                                          finish_reason=FinishReason.ERROR, error=self._dead))

    def _send(self, message: tuple[str, Any]) -> None:
        if self._dead or self._conn is None:
            return
        try:
            self._conn.send(message)
        except (OSError, ValueError):
            self._core_died()

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self._dead:
            yield EngineOutput(request_id=request.request_id, new_token_ids=[], finished=True,
                               finish_reason=FinishReason.ERROR, error=self._dead)
            return
        queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self._queues[request.request_id] = queue
        finished = False
        try:
            self._send(("add", request))
            while not finished:
                output = await queue.get()
                while not output.finished and not queue.empty():
                    output = merge_outputs(output, queue.get_nowait())
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._send(("abort", [request.request_id]))
            self._queues.pop(request.request_id, None)

    async def abort(self, request_id: str) -> None:
        if request_id in self._queues:
            self._send(("abort", [request_id]))

    async def shutdown(self) -> None:
        """Stop the core process; safe to call more than once."""
        if self._closed:
            return
        self._closed = True
        self._send(("shutdown", None))
        if self._process is not None:
            await asyncio.to_thread(self._process.join, 10)
            if self._process.is_alive():
                self._process.kill()
                await asyncio.to_thread(self._process.join, 5)
        if self._conn is not None:
            self._conn.close()

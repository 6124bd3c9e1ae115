"""Templating and tokenizing off the worker's event loop, for real.

The Rust tokenizer holds the GIL for the whole of an `encode` (a thread does not help: 1 MB of
text froze the loop for seconds, its heartbeats, acks and every stream's frames with it). So a
prompt longer than `INLINE_CHARS` is templated and tokenized in a process of this model's own pool
(`Tokenizing`), started on first use with the model's tokenizer; shorter ones, a few milliseconds
of work, are done inline, as a round trip to a process would cost more. At most `processes` jobs
run at once per model (the worker's bound on this work); more wait their turn on the loop, which
costs nothing.

What runs in the pool is what runs inline: `prompt.build_prompt` (a generation's prompt) and
`token_service.tokenize` (the `tokenize` endpoint), so counts and prompts are the same either way.
A pool process that dies (killed, out of memory) fails the jobs it held and is replaced.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

from engine.frontend import parent_death
from engine.frontend.tokenizer import Tokenizer

log = logging.getLogger("helexa.worker")

T = TypeVar("T")

# Text (characters) templated and tokenized inline: ~10 ms of a tokenizer's time, less than the
# round trip of a 1 MB request to a process and back.
INLINE_CHARS = 1 << 15

# The tokenizer of the model a pool process serves, set when the process starts.
_tokenizer: Tokenizer | None = None


def _start(tokenizer: Tokenizer, worker_pid: int) -> None:
    global _tokenizer
    # It dies with its worker, however the worker ends (the pool is started from its loop's thread).
    parent_death.arm(signal.SIGKILL, worker_pid)
    _tokenizer = tokenizer


def _with_tokenizer(job: Callable[..., T], *args: Any) -> T:
    """In a pool process: `job(tokenizer, *args)` with the model's tokenizer."""
    assert _tokenizer is not None, "the pool process has no tokenizer"
    return job(_tokenizer, *args)


class Tokenizing:
    """Where one model's prompts are templated and tokenized: inline when short, else in its pool."""

    def __init__(self, tokenizer: Tokenizer, processes: int = 1, inline_chars: int = INLINE_CHARS) -> None:
        if processes < 1:
            raise ValueError("a tokenizing pool needs at least one process")
        self.tokenizer = tokenizer
        self.processes = processes
        self.inline_chars = inline_chars
        self._pool: ProcessPoolExecutor | None = None
        self._slots = asyncio.Semaphore(processes)
        # Jobs run in the pool (tests and operators can tell the pool was used).
        self.pooled = 0

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            # Spawned, not forked: the worker has threads (NATS, the engine's reader and writer).
            self._pool = ProcessPoolExecutor(max_workers=self.processes,
                                             mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start, initargs=(self.tokenizer, os.getpid()))
        return self._pool

    async def run(self, chars: int, job: Callable[..., T], *args: Any) -> T:
        """`job(tokenizer, *args)` for `chars` characters of text: inline when that is little,
        else in the pool, never holding the event loop longer than a short job does."""
        if chars <= self.inline_chars:
            return job(self.tokenizer, *args)
        async with self._slots:
            self.pooled += 1
            pool = self._executor()
            try:
                return await asyncio.wrap_future(pool.submit(_with_tokenizer, job, *args))
            except BrokenProcessPool:
                log.warning("a tokenizing process died; the pool is replaced")
                if self._pool is pool:
                    self._pool = None
                    pool.shutdown(wait=False, cancel_futures=True)
                raise

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

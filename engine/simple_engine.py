"""The simplest `Engine`: one request at a time, prefill then decode with a contiguous KV cache.

Torch work runs on one dedicated worker thread so the asyncio loop (NATS I/O, detokenization)
never blocks on a forward pass. Requests queue up in submission order; each one's outputs cross
back to its caller's loop with `call_soon_threadsafe` into an `asyncio.Queue`. Whatever happens
in the worker, the caller gets a final output: stop, length, abort or error, never silence.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch

from engine.api import EngineOutput, EngineRequest, FinishReason
from engine.loader import Checkpoint
from engine.sampler import make_generator, sample

logger = logging.getLogger(__name__)


def _num_torch_threads() -> int:
    # One intra-op thread per CPU this process may run on; more only adds contention.
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


@dataclass(slots=True)
class _Job:
    """A submitted request and the way back to its caller."""

    request: EngineRequest
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue[EngineOutput]
    aborted: threading.Event = field(default_factory=threading.Event)

    def emit(self, output: EngineOutput) -> None:
        try:
            self.loop.call_soon_threadsafe(self.outputs.put_nowait, output)
        except RuntimeError:
            self.aborted.set()  # the caller's loop is closed; nobody is listening

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        """The final output when no token comes with it (abort, error)."""
        self.emit(EngineOutput(request_id=self.request.request_id, new_token_ids=[],
                               finished=True, finish_reason=reason, error=error))


class SimpleEngine:
    """`Engine` over one `Checkpoint`, one sequence at a time (max_num_seqs = 1)."""

    max_num_seqs = 1

    def __init__(self, checkpoint: Checkpoint, max_model_len: int | None = None) -> None:
        self.checkpoint = checkpoint
        self.model = checkpoint.model
        self.model_id = checkpoint.model_id
        limit = checkpoint.config.max_position_embeddings
        self.max_model_len = limit if max_model_len is None else min(max_model_len, limit)
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be positive")
        self._eos_token_ids = set(checkpoint.tokenizer.all_stop_token_ids)
        self._jobs: dict[str, _Job] = {}  # submitted and not yet finished
        self._work: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        torch.set_num_threads(_num_torch_threads())
        self._worker = threading.Thread(target=self._run, name="simple-engine", daemon=True)
        self._worker.start()

    def free_slots(self) -> int:
        return 0 if self._jobs or self._closed else self.max_num_seqs

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        job = _Job(request, asyncio.get_running_loop(), asyncio.Queue())
        if self._closed:
            job.finish(FinishReason.ERROR, "engine is shut down")
        elif request.request_id in self._jobs:
            job.finish(FinishReason.ERROR, f"request id {request.request_id!r} is already running")
        else:
            self._jobs[request.request_id] = job
            self._work.put(job)
        finished = False
        try:
            while not finished:
                output = await job.outputs.get()
                finished = output.finished
                yield output
        finally:
            # Reached on completion and also when the caller stops iterating early.
            job.aborted.set()
            if self._jobs.get(request.request_id) is job:
                del self._jobs[request.request_id]

    async def abort(self, request_id: str) -> None:
        job = self._jobs.get(request_id)
        if job is not None:
            job.aborted.set()

    async def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for job in list(self._jobs.values()):
            job.aborted.set()
        self._work.put(None)
        await asyncio.to_thread(self._worker.join)

    def _run(self) -> None:
        while (job := self._work.get()) is not None:
            try:
                with torch.inference_mode():
                    self._generate(job)
            except Exception as exc:  # the model failing must end the request, not the worker
                logger.exception("request %s failed", job.request.request_id)
                job.finish(FinishReason.ERROR, f"{type(exc).__name__}: {exc}")

    def _generate(self, job: _Job) -> None:
        request, sampling = job.request, job.request.sampling
        prompt = request.prompt_token_ids
        if job.aborted.is_set():
            job.finish(FinishReason.ABORT)
            return
        if not prompt:
            job.finish(FinishReason.ERROR, "prompt is empty")
            return
        if len(prompt) > self.max_model_len:
            job.finish(FinishReason.ERROR, f"prompt has {len(prompt)} tokens, more than "
                                           f"max_model_len ({self.max_model_len})")
            return

        # The last sampled token is never fed back, so the cache needs one slot less than the total.
        max_len = min(self.max_model_len, len(prompt) + sampling.max_tokens)
        kv_cache = self.model.new_kv_cache(max_len)
        generator = make_generator(sampling.seed)
        stop_ids = set(sampling.stop_token_ids)
        if not sampling.ignore_eos:
            stop_ids |= self._eos_token_ids

        start = time.perf_counter()
        input_ids = torch.tensor(prompt, dtype=torch.long)
        positions = torch.arange(len(prompt))
        logits = self.model(input_ids, positions, kv_cache)
        token = sample(logits[-1], sampling, generator)
        prefill_ms = (time.perf_counter() - start) * 1000.0

        num_output = 0
        while True:
            num_output += 1
            num_tokens = len(prompt) + num_output
            if token in stop_ids:
                reason: FinishReason | None = FinishReason.STOP
            elif num_output >= sampling.max_tokens or num_tokens >= self.max_model_len:
                reason = FinishReason.LENGTH
            else:
                reason = None
            output = EngineOutput(request_id=request.request_id, new_token_ids=[token],
                                  finished=reason is not None, finish_reason=reason)
            if num_output == 1:
                output.num_prompt_tokens = len(prompt)
                output.prefill_ms = prefill_ms
            job.emit(output)
            if reason is not None:
                return
            if job.aborted.is_set():
                job.finish(FinishReason.ABORT)
                return
            position = torch.tensor([num_tokens - 1])
            logits = self.model(torch.tensor([token]), position, kv_cache)
            token = sample(logits[-1], sampling, generator)

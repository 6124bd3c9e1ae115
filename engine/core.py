"""The engine core: schedule → run the model → sample → update, one step at a time.

`EngineCore` is synchronous and owns every torch object; `run_core_process` drives it in its own
process behind a pipe of `engine.protocol` messages (the client side is `engine.core_client`), so
the worker's event loop never waits on torch and never imports it.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from multiprocessing.connection import Connection

import msgspec
import torch

from engine.cuda_graphs import DecodeGraphs, graphs_wanted
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.loader import Checkpoint
from engine.model_runner import ModelRunner, kv_bytes_per_token
from engine.protocol import (
    AbortRequests,
    AddRequest,
    CoreFailed,
    CoreInfo,
    CoreReady,
    CoreStats,
    EngineOutput,
    EngineRequest,
    FinishReason,
    FromCore,
    Shutdown,
    StepOutputs,
    TokenLogprob,
    device_fault_message,
    encode_message,
    to_core_decoder,
)
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from engine.state_slots import StateSlotPool

log = logging.getLogger("helexa.engine")


class EngineCore:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self.config = config
        self.checkpoint = checkpoint
        model_config = checkpoint.config
        dtype = next(checkpoint.model.parameters()).dtype
        block_size = config.block_size
        num_blocks = config.num_kv_blocks or max(
            config.kv_cache_bytes // (kv_bytes_per_token(model_config, dtype) * block_size), 1
        )
        max_model_len = min(
            config.max_model_len or model_config.max_position_embeddings,
            model_config.max_position_embeddings,
            num_blocks * block_size,
        )
        state_shape = getattr(checkpoint.model, "linear_state_shape", None)
        is_hybrid = state_shape is not None
        if is_hybrid:
            log.info("%s: %d linear-attention state slots, %.1f MiB beside the KV cache",
                     checkpoint.model_id, config.max_num_seqs,
                     config.max_num_seqs * state_shape.bytes_per_slot(dtype) / (1 << 20))
        enable_prefix_caching = config.enable_prefix_caching
        if is_hybrid and enable_prefix_caching:
            # A cached KV prefix is useless without the linear layers' state at that point.
            log.info("prefix caching disabled for %s: hybrid (linear-attention) model",
                     checkpoint.model_id)
            enable_prefix_caching = False
        # One state slot per sequence that may run at once.
        self.state_slots = StateSlotPool(config.max_num_seqs) if is_hybrid else None
        self.kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=max(config.max_num_batched_tokens, 1),
                max_model_len=max_model_len,
            ),
            self.kv_cache,
            self.state_slots,
        )
        device = next(checkpoint.model.parameters()).device
        self.runner = ModelRunner(checkpoint.model, model_config, num_blocks, block_size, device, dtype,
                                  num_state_slots=config.max_num_seqs if is_hybrid else 0)
        if graphs_wanted(config.cuda_graphs, device):
            if is_hybrid:
                # Graph capture covers the paged-KV forward only; state-slot models decode eagerly.
                log.info("CUDA graphs off for %s: hybrid (linear-attention) model", checkpoint.model_id)
            else:
                self.runner.decode_graphs = DecodeGraphs.capture(
                    checkpoint.model, self.runner.kv_caches, config.max_num_seqs, max_model_len,
                    block_size, device)
        self.info = CoreInfo(
            model_id=checkpoint.model_id,
            max_model_len=max_model_len,
            max_num_seqs=config.max_num_seqs,
            num_blocks=num_blocks,
            block_size=block_size,
            eos_token_ids=checkpoint.tokenizer.all_stop_token_ids,
            max_position_embeddings=model_config.max_position_embeddings,
            dtype=str(dtype).removeprefix("torch."),
        )
        self.stats = CoreStats(num_blocks=num_blocks)
        self._refresh_stats()
        self._first_scheduled: dict[str, float] = {}
        self._requests: dict[str, Request] = {}
        self._rejected: list[EngineOutput] = []

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id}")
        if request.sampling.max_tokens is None:
            raise ValueError(f"request {request.request_id}: max_tokens must be resolved before the engine")
        if len(request.prompt_token_ids) + 1 > self.info.max_model_len:
            self._rejected.append(self._final(request.request_id, FinishReason.ERROR, len(request.prompt_token_ids),
                                              error="prompt exceeds max_model_len"))
            return
        engine_request = Request(request.request_id, request.prompt_token_ids, request.sampling,
                                 eos_token_ids=self.info.eos_token_ids)
        self._requests[request.request_id] = engine_request
        self.scheduler.add_request(engine_request)

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        outputs = []
        for request in self.scheduler.abort_requests(request_ids):
            outputs.append(self._final(request.request_id, FinishReason.ABORT, request.num_prompt_tokens))
            self._forget(request.request_id)
        self._refresh_stats()
        return outputs

    def fail_all(self, error: str) -> list[EngineOutput]:
        """A step raised: every live request ends with an error; the core itself carries on."""
        outputs = []
        for request in self.scheduler.abort_requests(list(self._requests)):
            outputs.append(self._final(request.request_id, FinishReason.ERROR, request.num_prompt_tokens, error))
            self._forget(request.request_id)
        self._refresh_stats()
        return outputs

    def has_work(self) -> bool:
        return bool(self._rejected) or self.scheduler.has_unfinished()

    def step(self) -> list[EngineOutput]:
        outputs, self._rejected = self._rejected, []
        step = self.scheduler.schedule()
        if not step.scheduled:
            return outputs
        now = time.monotonic()
        for scheduled in step.scheduled:
            self._first_scheduled.setdefault(scheduled.request.request_id, now)
            request = scheduled.request
            if request.num_computed_tokens < request.num_prompt_tokens:
                self.stats.prompt_tokens_computed += min(
                    scheduled.num_new_tokens, request.num_prompt_tokens - request.num_computed_tokens
                )
        sampled = self.runner.execute(step)
        got_token, finished = self.scheduler.update_from_output(step, {k: v[0] for k, v in sampled.items()})
        done = time.monotonic()
        for request in got_token:
            _, logprob = sampled[request.request_id]
            outputs.append(self._output(request, logprob, done))
        for request in finished:
            if request.request_id not in sampled:
                outputs.append(self._final(request.request_id, request.status.finish_reason or FinishReason.ERROR,
                                           request.num_prompt_tokens))
            self._forget(request.request_id)
        self._update_stats(len(got_token))
        return outputs

    def _output(self, request: Request, logprob: TokenLogprob | None, now: float) -> EngineOutput:
        first = request.num_output_tokens == 1
        prefill_ms = None
        if first:
            prefill_ms = (now - self._first_scheduled.get(request.request_id, now)) * 1000.0
        return EngineOutput(
            request_id=request.request_id,
            new_token_ids=[request.output_token_ids[-1]],
            logprobs=[logprob] if logprob is not None else None,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            prefill_ms=prefill_ms,
        )

    def _final(self, request_id: str, reason: FinishReason, num_prompt_tokens: int,
               error: str | None = None) -> EngineOutput:
        return EngineOutput(request_id=request_id, new_token_ids=[], finished=True, finish_reason=reason,
                            num_prompt_tokens=num_prompt_tokens, error=error)

    def _forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)
        self._first_scheduled.pop(request_id, None)
        self.runner.release(request_id)

    def _update_stats(self, generated: int) -> None:
        self.stats.steps += 1
        self.stats.generated_tokens += generated
        self._refresh_stats()

    def _refresh_stats(self) -> None:
        s = self.stats
        s.num_free_blocks = self.kv_cache.num_free_blocks
        s.num_running = self.scheduler.num_running
        s.num_waiting = self.scheduler.num_waiting
        s.num_preemptions = self.scheduler.num_preemptions
        s.prefix_queries = self.kv_cache.prefix_queries
        s.prefix_hits = self.kv_cache.prefix_hits
        if self.state_slots is not None:
            s.num_state_slots = self.state_slots.num_slots
            s.num_free_state_slots = self.state_slots.num_free


def build_core(config: EngineConfig) -> EngineCore:
    from engine.dtype_cache import default_cache_path
    from engine.dtype_choice import choose_dtype
    from engine.loader import load_checkpoint, read_model_config

    if config.device == "auto":
        config = dataclasses.replace(config, device="cuda" if torch.cuda.is_available() else "cpu")
    choice = choose_dtype(config, read_model_config(config.model), torch.device(config.device).type,
                          default_cache_path())
    checkpoint = load_checkpoint(config.model, dtype=choice.torch_dtype, device=config.device)
    core = EngineCore(checkpoint, config)
    core.info = msgspec.structs.replace(core.info, dtype=choice.dtype, dtype_reason=choice.reason,
                                        dtype_timings_ms=choice.timings_ms)
    return core


def run_core_process(conn: Connection, config: EngineConfig) -> None:
    """The core process: load the model, then step whenever there is work, until told to stop."""
    # Ctrl-C reaches the whole process group; the worker owns shutdown and stops us through the
    # pipe (or by closing it), so an interrupted terminal does not look like a crashed engine.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def send(message: FromCore) -> None:
        conn.send_bytes(encode_message(message))

    try:
        core = build_core(config)
    except Exception as exc:  # reported to the parent, which decides what to do
        send(CoreFailed(error=f"{type(exc).__name__}: {exc}"))
        return
    send(CoreReady(info=core.info))
    while True:
        outputs: list[EngineOutput] = []
        try:
            # Block for commands only when idle; otherwise just take what has arrived.
            if not core.has_work():
                conn.poll(None)
            while conn.poll():
                message = to_core_decoder.decode(conn.recv_bytes())
                if isinstance(message, AddRequest):
                    core.add_request(message.request)
                elif isinstance(message, AbortRequests):
                    outputs.extend(core.abort(message.request_ids))
                elif isinstance(message, Shutdown):
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
                send(StepOutputs(outputs=outputs, stats=core.stats))
            except (EOFError, OSError):
                return

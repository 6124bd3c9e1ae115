"""The engine core: schedule → run the model → sample → update, one step at a time.

`EngineCore` is synchronous and owns every torch object; `run_core_process` drives it in its own
process behind a pipe (see `engine.core_client`), so the worker's event loop never waits on torch.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from engine.api import EngineOutput, EngineRequest, FinishReason, TokenLogprob
from engine.cuda_graphs import DecodeGraphs, graphs_wanted
from engine.engine_config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.loader import Checkpoint
from engine.model_runner import ModelRunner, kv_bytes_per_token
from engine.request import Request, RequestStatus
from engine.scheduler import Scheduler, SchedulerConfig
from engine.state_slots import StateSlotPool

log = logging.getLogger("helexa.engine")


@dataclass(slots=True)
class CoreStats:
    """Cumulative counters and the pool's state, sent to the worker after each step."""

    num_blocks: int = 0
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Hybrid models: linear-attention state slots (0 and 0 for models without them).
    num_state_slots: int = 0
    num_free_state_slots: int = 0
    prompt_tokens_computed: int = 0
    generated_tokens: int = 0
    steps: int = 0

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks if self.num_blocks else 0.0


@dataclass(slots=True)
class CoreInfo:
    """What the core tells its client once the model is loaded."""

    model_id: str
    max_model_len: int
    max_num_seqs: int
    num_blocks: int
    block_size: int
    eos_token_ids: list[int] = field(default_factory=list)
    max_position_embeddings: int = 0


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
        )
        self.stats = CoreStats(num_blocks=num_blocks)
        self._refresh_stats()
        self._first_scheduled: dict[str, float] = {}
        self._requests: dict[str, Request] = {}
        self._rejected: list[EngineOutput] = []

    def add_request(self, request: EngineRequest) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"duplicate request id {request.request_id}")
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
    from engine.loader import load_checkpoint

    dtype = getattr(torch, config.torch_dtype_name)
    checkpoint = load_checkpoint(config.model, dtype=dtype, device=config.device)
    return EngineCore(checkpoint, config)

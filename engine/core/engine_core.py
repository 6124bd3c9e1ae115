"""The engine core: schedule → run the model → sample → update, one step at a time.

`EngineCore` is synchronous and owns every torch object through its `ModelRunner`; the scheduler owns
the request table. `engine.core.core_process` builds it and drives it in its own process behind a pipe
of `engine.frontend.protocol` messages (the client side is `engine.frontend.core_client`), so the
worker's event loop never waits on torch and never imports it.

A failure belongs to the request that caused it. Requests that can never run are refused at add
(the scheduler's rejections); a row the sampler cannot sample ends alone; a step that raises is run
again one request at a time, so only the request it belongs to ends with `finish_reason: "error"`.
Only a device fault (`engine.frontend.protocol.device_fault_message`), or an error no request can be blamed
for, ends every request in flight. At `tensor_parallel` N > 1 the core is rank 0 of a group
(`engine.runner.tensor_parallel`); a lost group ends the core process, which the worker sees as a
core death.
"""

from __future__ import annotations

import logging
import time

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import (
    ScheduledRequest,
    Scheduler,
    SchedulerConfig,
    SchedulerOutput,
)
from engine.core.state_slots import StateSlotPool
from engine.core.structured_output import GrammarEnd, StructuredOutputs
from engine.frontend.engine_config import EngineConfig
from engine.frontend.protocol import (
    CoreInfo,
    CoreStats,
    EngineOutput,
    EngineRequest,
    FinishReason,
    TokenLogprob,
    device_fault_message,
    is_device_fault,
)
from engine.loading.loader import Checkpoint
from engine.runner import ops
from engine.runner.model_runner import ModelRunner, StepResult
from engine.runner.tensor_parallel import Followers, GroupLost

log = logging.getLogger("helexa.engine")

# How often a core with nothing to step but grammars compiling looks at them again.
GRAMMAR_POLL_S = 0.005


class EngineCore:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig, followers: Followers | None = None) -> None:
        self.config = config
        self.checkpoint = checkpoint
        model_config = checkpoint.config
        # The kernel choice is made once per engine, for the device its weights are on.
        ops.use_backend(config.kernels, next(checkpoint.model.parameters()).device)
        self.runner = ModelRunner(checkpoint.model, model_config, config, checkpoint.model_id)
        if followers is not None:  # every rank allocates rank 0's number of KV blocks
            followers.await_ready(self.runner.num_blocks)
            self.runner.followers = followers
        enable_prefix_caching = config.enable_prefix_caching
        if self.runner.is_hybrid and enable_prefix_caching:
            # A cached KV prefix is useless without the linear layers' state at that point.
            log.info("prefix caching disabled for %s: hybrid (linear-attention) model",
                     checkpoint.model_id)
            enable_prefix_caching = False
        # One state slot per sequence that may run at once.
        self.state_slots = StateSlotPool(config.max_num_seqs) if self.runner.is_hybrid else None
        self.kv_cache = KVCacheManager(self.runner.num_blocks, config.block_size, enable_prefix_caching)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.runner.max_model_len,
                vocab_size=model_config.vocab_size,
                batch_aging_steps=config.batch_aging_steps,
                batch_step_interval=config.batch_step_interval,
                batch_prefill_tokens=config.batch_prefill_tokens,
                batch_narrow_s=config.batch_narrow_s,
                batch_narrow_tokens=config.batch_narrow_tokens,
            ),
            self.kv_cache,
            self.state_slots,
        )
        self.info = CoreInfo(
            model_id=checkpoint.model_id,
            max_model_len=self.runner.max_model_len,
            max_num_seqs=config.max_num_seqs,
            num_blocks=self.runner.num_blocks,
            block_size=config.block_size,
            eos_token_ids=checkpoint.tokenizer.all_stop_token_ids,
            max_position_embeddings=model_config.max_position_embeddings,
            dtype=str(self.runner.dtype).removeprefix("torch."),
            tensor_parallel=self.runner.tensor_parallel,
        )
        # Grammar-constrained requests (engine.core.structured_output): masks before sampling.
        self.structured = StructuredOutputs(checkpoint.tokenizer, model_config.vocab_size,
                                            self.info.eos_token_ids, config.max_num_seqs, self.runner.device)
        self.runner.mask_logits = self.structured.mask_logits
        # Constrained requests whose grammar is compiling, by id, in arrival order.
        self._compiling: dict[str, Request] = {}
        self.stats = CoreStats(num_blocks=self.runner.num_blocks)
        self._refresh_stats()
        self._first_scheduled: dict[str, float] = {}

    def add_request(self, request: EngineRequest) -> None:
        """Queue a request; one that can never run comes back as an error output of the next step,
        and a resumed one that had already ended (its last token a stop, or no tokens left) as a
        token-less finish. A constrained request waits beside the scheduler until its grammar has
        compiled (`_admit_compiled`)."""
        engine_request = Request(request.request_id, request.prompt_token_ids, request.sampling,
                                 eos_token_ids=self.info.eos_token_ids,
                                 resumed_token_ids=request.resumed_token_ids,
                                 service_class=request.service_class, priority=request.priority,
                                 cache_salt=request.cache_salt)
        structured = request.sampling.structured
        if request.request_id in self._compiling:
            # Its grammar would replace the waiting one's: refused as the scheduler refuses a duplicate.
            self.scheduler.reject(engine_request, f"duplicate request id {request.request_id!r}: a request "
                                                  "with that id is already in the engine")
            return
        # A duplicate id is the scheduler's to refuse; its grammar must not replace the live one's.
        if structured is not None and request.request_id not in self.scheduler.requests:
            self._compiling[request.request_id] = engine_request
            self.structured.add(request.request_id, structured, request.resumed_token_ids)
            self._admit_compiled()  # a grammar compiled before goes on at once
            return
        self.scheduler.add_request(engine_request)

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled go to the scheduler; those whose grammar failed (or
        ran past its budget) end alone, with a short error."""
        for request_id, error in self.structured.ready():
            request = self._compiling.pop(request_id)
            if error is None:
                self.scheduler.add_request(request)
            else:
                self.structured.release(request_id)
                self.scheduler.reject(request, f"structured output does not compile: {error}")

    @property
    def only_compiling(self) -> bool:
        """Nothing to step but grammars compiling: the loop waits for them (or a message)."""
        return bool(self._compiling) and not self.scheduler.has_unfinished()

    def abort(self, request_ids: list[str]) -> list[EngineOutput]:
        outputs = []
        for request_id in request_ids:
            request = self._compiling.pop(request_id, None)
            if request is not None:
                self.structured.release(request_id)
                request.status = RequestStatus.FINISHED_ABORTED
                outputs.append(self._end_one(request))
        return outputs + self._end(self.scheduler.abort_requests(request_ids))

    def fail_all(self, error: str) -> list[EngineOutput]:
        """A step raised and no request can be blamed: every live request ends with an error; the
        core itself carries on."""
        return self._end(self.scheduler.finish_requests(list(self.scheduler.requests),
                                                        RequestStatus.FINISHED_ERROR, error))

    def has_work(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def step(self) -> list[EngineOutput]:
        if self._compiling:
            self._admit_compiled()
        step = self.scheduler.schedule()
        result = StepResult()
        if step.scheduled:
            now = time.monotonic()
            for scheduled in step.scheduled:
                request = scheduled.request
                self._first_scheduled.setdefault(request.request_id, now)
                if request.num_computed_tokens < request.num_prompt_tokens:
                    self.stats.prompt_tokens_computed += min(
                        scheduled.num_new_tokens, request.num_prompt_tokens - request.num_computed_tokens)
            result = self._execute(step)
        # Rows that failed end now, alone: the update below skips requests no longer running.
        outputs = []
        for request_id, error in result.failed.items():
            log.warning("request %s failed alone: %s", request_id, error)
            failed = self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ERROR, error)
            outputs += [self._end_one(request) for request in failed]
        sampled_tokens = {request_id: token for request_id, (token, _) in result.sampled.items()}
        grammar_ends = self.structured.consume(sampled_tokens)
        # Always: it also hands back the requests the scheduler rejected at add.
        got_token, finished = self.scheduler.update_from_output(step, sampled_tokens)
        done = time.monotonic()
        for request in got_token:
            _, logprob = result.sampled[request.request_id]
            outputs.append(self._output(request, logprob, done))
        with_token = {id(request) for request in got_token}
        for request in finished:
            if id(request) in with_token:
                self._forget(request)
            else:  # ended at add: a request of its own, even when it repeats a live id
                outputs.append(self._end_one(request))
        outputs += self._end_by_grammar(grammar_ends)
        outputs += [EngineOutput(request_id=p.request_id, new_token_ids=[], preempted=p.reason,
                                 tokens_kept=p.tokens_kept)
                    for p in step.preemptions if p.request_id in self.scheduler.requests]
        if step.scheduled:
            self._update_stats(len(got_token))
        else:
            self._refresh_stats()
        return outputs

    def _end_by_grammar(self, ends: list[GrammarEnd]) -> list[EngineOutput]:
        """Stop the requests whose grammar is complete, fail those whose grammar failed; a request
        the scheduler already finished this step (an EOS the grammar accepted) needs nothing."""
        outputs = []
        for end in ends:
            status = RequestStatus.FINISHED_STOPPED if end.error is None else RequestStatus.FINISHED_ERROR
            for request in self.scheduler.finish_requests([end.request_id], status, end.error):
                outputs.append(self._end_one(request))
        return outputs

    def _execute(self, step: SchedulerOutput) -> StepResult:
        """Run the step. If it raises with no device fault, run each request alone: the ones that
        still raise fail, the rest get their tokens. A device fault propagates (see the module doc)."""
        try:
            return self.runner.execute(step)
        except GroupLost:
            raise
        except Exception as exc:
            message = device_fault_message(exc)
            if is_device_fault(message):
                raise
            if len(step.scheduled) == 1:
                log.warning("engine step failed for one request", exc_info=True)
                return StepResult(failed={step.scheduled[0].request.request_id: message})
            log.warning("engine step failed; running its %d requests one at a time", len(step.scheduled),
                        exc_info=True)
        result = StepResult()
        for item in step.scheduled:
            try:
                alone = self._run_alone(item)
            except Exception as exc:
                message = device_fault_message(exc)
                if is_device_fault(message):
                    raise
                result.failed[item.request.request_id] = message
                continue
            result.sampled.update(alone.sampled)
            result.failed.update(alone.failed)
        return result

    def _run_alone(self, item: ScheduledRequest) -> StepResult:
        request = item.request
        if not self.runner.is_hybrid:
            # Re-running a chunk rewrites the same KV slots with the same values: safe to repeat.
            return self.runner.execute(SchedulerOutput([item], [], item.num_new_tokens))
        # The failed batch may have advanced this sequence's linear state part way; recompute the
        # whole sequence up to the same point from a zero state (blocks already cover it).
        computed = request.num_computed_tokens
        request.num_computed_tokens = 0
        try:
            whole = ScheduledRequest(request, computed + item.num_new_tokens, item.sample)
            return self.runner.execute(SchedulerOutput([whole], [], whole.num_new_tokens))
        finally:
            request.num_computed_tokens = computed

    def _output(self, request: Request, logprob: TokenLogprob | None, now: float) -> EngineOutput:
        first = request.num_output_tokens == request.num_resumed_tokens + 1
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

    def _end(self, requests: list[Request]) -> list[EngineOutput]:
        outputs = [self._end_one(request) for request in requests]
        self._refresh_stats()
        return outputs

    def _end_one(self, request: Request) -> EngineOutput:
        """The final, token-less output of a request that ended without a new token."""
        self._forget(request)
        return EngineOutput(request_id=request.request_id, new_token_ids=[], finished=True,
                            finish_reason=request.status.finish_reason or FinishReason.ERROR,
                            num_prompt_tokens=request.num_prompt_tokens, error=request.error)

    def _forget(self, request: Request) -> None:
        # A rejected duplicate shares its id with a live request, whose state must stay.
        if request.request_id in self.scheduler.requests or request.request_id in self._compiling:
            return
        self._first_scheduled.pop(request.request_id, None)
        self.structured.release(request.request_id)
        self.runner.sampler.forget(request.request_id)

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
        s.preemptions_by_reason = dict(self.scheduler.preemptions_by_reason)
        s.num_batch_running = self.scheduler.num_batch_running
        s.num_batch_waiting = self.scheduler.num_batch_waiting
        s.prefix_queries = self.kv_cache.prefix_queries
        s.prefix_hits = self.kv_cache.prefix_hits
        s.grammar_compiles = self.structured.compiles
        s.grammar_cache_hits = self.structured.cache_hits
        tallies = self.runner.rank_tallies()
        s.rank_steps = [t.steps for t in tallies]
        s.rank_step_seconds = [t.seconds for t in tallies]
        s.cpu_threads = self.runner.cpu_threads
        if self.state_slots is not None:
            s.num_state_slots = self.state_slots.num_slots
            s.num_free_state_slots = self.state_slots.num_free


    def close(self) -> None:
        """End the tensor-parallel group, if any (its ranks exit), and give torch back the thread
        count it started with."""
        if self.runner.thread_governor is not None:
            self.runner.thread_governor.restore()
        if self.runner.followers is not None:
            self.runner.followers.close()
            self.runner.followers = None

"""What runs this step: continuous batching under one token budget, chunked prefill, priority
classes, preemption.

Each step the running requests go first (a decode is one token; a request still mid-prefill gets its
next chunk), interactive before batch and each in arrival order; then waiting requests are admitted
while the budget, `max_num_seqs` and the KV cache allow, in the order: interactive before batch,
then by `priority` (lower first), then arrival; a preempted request goes first in its class. When a
running request cannot get a block, the newest running request is preempted (`kv_cache_full`):
its blocks are freed and it is later recomputed from scratch over its prompt and outputs so far,
cheaply when its blocks are still in the prefix cache. Batch requests run last, so they are the
newest and go first.

Priority classes: a waiting interactive request that finds no seat, state slot or KV room preempts
running batch sequences, newest first, until it fits (`interactive_waiting`); it never preempts
interactive work, and batch work never preempts anything for itself. While an interactive request
waits, running batch requests still mid-prefill get no chunk, so the step's token budget is its.

Batch turns: while interactive work runs or waits, the running batch requests that were not
preempted keep their seats and KV blocks but are computed in only one step of every
`batch_step_interval` (their turn), and waiting batch requests are admitted only in those steps;
the other steps carry interactive work alone, so they cost what
they would without the batch (on a CPU a step's time grows with its rows). With no interactive
work every step is a batch turn. Waiting batch requests are bounded by aging: every step one spends
waiting counts (across preemptions); after `batch_aging_steps` of them it is admitted as interactive
and is no longer preempted or held to turns, so a batch request waits at most that many steps plus
the time interactive work ahead of it takes, and once running it is computed at least once every
`batch_step_interval` steps. Batch prompts go through at most `batch_prefill_tokens` a step (in
chunks, as any prefill), in every step, so the step an interactive request arrives during is short
even when no interactive work was running to hold batch work to its turns.

Narrow batch steps: for `batch_narrow_s` after interactive work last ran or waited, a step computes at
most `batch_narrow_tokens` batch tokens (decodes and prompt tokens alike), the running batch
requests taking turns (the least recently computed first), and a waiting batch request is admitted
only into what is left of them. An interactive request that arrives mid-step waits for the step in
flight; on a CPU a step's time grows with its tokens, so this keeps that wait short while
interactive traffic goes on, and leaves batch work its full width once it has stopped.

For hybrid models a running request also holds one linear-attention state slot (`StateSlotPool`):
taken on admission, so free slots cap the running set, and given back on finish, abort and
preemption (a recomputed request starts its state from zeros).

The scheduler owns the request table: every live request by id, and the requests that end at add
(refused because they can never run, without touching any live request's state; or resumed ones whose
answer was already complete), handed back by the next `update_from_output`. A resumed request (its
earlier outputs given at add) is scheduled like a preempted one: prompt and outputs recomputed, then
decoding goes on. It never advances a request at schedule time; `update_from_output` does, once
the step's tokens are computed. No torch here.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from engine.core.kv_cache import KVCacheManager
from engine.core.request import Request, RequestStatus
from engine.core.state_slots import StateSlotPool
from engine.frontend.protocol import PreemptionReason, ServiceClass

KV_CACHE_FULL = PreemptionReason.KV_CACHE_FULL
INTERACTIVE_WAITING = PreemptionReason.INTERACTIVE_WAITING


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    # Token ids a prompt may hold are 0..vocab_size-1 (the model's embedding rows); 0: unchecked.
    vocab_size: int = 0
    # Steps a batch request may wait (in all) before it is admitted as interactive work.
    batch_aging_steps: int = 512
    # While interactive work runs or waits, running batch requests are computed in one step of this many.
    batch_step_interval: int = 8
    # Prompt tokens of batch requests one step computes at most (their chunks), so a step holding
    # batch prefill stays short for an interactive request arriving during it.
    batch_prefill_tokens: int = 64
    # For this long after interactive work last ran or waited (0: never), a step computes at most
    # batch_narrow_tokens batch tokens, decodes and prompt tokens alike.
    batch_narrow_s: float = 10.0
    batch_narrow_tokens: int = 16

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be at least 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be at least 1")
        if self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")
        if self.vocab_size < 0:
            raise ValueError("vocab_size must be >= 0")
        if self.batch_aging_steps < 1:
            raise ValueError("batch_aging_steps must be at least 1")
        if self.batch_step_interval < 1:
            raise ValueError("batch_step_interval must be at least 1")
        if self.batch_prefill_tokens < 1:
            raise ValueError("batch_prefill_tokens must be at least 1")
        if not 0 <= self.batch_narrow_s <= 3600:
            raise ValueError("batch_narrow_s must be between 0 and 3600")
        if self.batch_narrow_tokens < 1:
            raise ValueError("batch_narrow_tokens must be at least 1")


@dataclass(slots=True)
class ScheduledRequest:
    """Compute `request.all_token_ids[request.num_computed_tokens:][:num_new_tokens]` this step."""

    request: Request
    num_new_tokens: int
    # The chunk reaches the request's last token, so the runner samples the next one.
    sample: bool


@dataclass(slots=True)
class Preemption:
    request_id: str
    reason: PreemptionReason
    service_class: ServiceClass
    # Generated tokens it keeps (recomputed with the prompt when it runs again).
    tokens_kept: int


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    preempted: list[str]
    num_batched_tokens: int
    # One per id in `preempted`, with its reason.
    preemptions: list[Preemption] = field(default_factory=list)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache: KVCacheManager,
                 state_slots: StateSlotPool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config
        self._clock = clock
        self.kv_cache = kv_cache
        self.state_slots = state_slots
        self.waiting: deque[Request] = deque()
        # Kept in arrival order, so the newest running request is always the last one.
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.preemptions_by_reason = dict.fromkeys(PreemptionReason, 0)
        self._arrival: dict[str, int] = {}
        self._next_arrival = 0
        # Preempted requests waiting to run again, by when: the latest preempted comes first.
        self._front: dict[str, int] = {}
        self._next_front = 0
        # Batch requests that waited batch_aging_steps: admitted, and kept, as interactive work.
        self._aged: set[str] = set()
        # Steps with interactive work since running batch requests last had a turn.
        self._steps_since_batch_turn = 0
        # When interactive work last ran or waited (narrow batch steps follow it), and when each
        # running batch request was last computed, counted in turns given (narrow steps go round).
        self._interactive_seen_at = -math.inf
        self._batch_turns_given = 0
        self._batch_computed_at: dict[str, int] = {}
        # Ended at add time (refused, or resumed complete); handed back in the next
        # update_from_output's finished list.
        self._ended_at_add: list[Request] = []
        # One sequence can never outgrow the whole pool.
        self.max_seq_len = min(config.max_model_len, kv_cache.num_blocks * kv_cache.block_size)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_batch_running(self) -> int:
        return sum(1 for r in self.running if r.service_class == ServiceClass.BATCH)

    @property
    def num_batch_waiting(self) -> int:
        return sum(1 for r in self.waiting if r.service_class == ServiceClass.BATCH)

    def next_step_is_full(self) -> bool:
        """The waiting requests alone would fill the next step (its token budget or its seats)."""
        if len(self.waiting) >= self.config.max_num_seqs:
            return True
        tokens = sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)
        return tokens >= self.config.max_num_batched_tokens

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._ended_at_add)

    def add_request(self, request: Request) -> None:
        """Queue a request. One that can never run is marked FINISHED_ERROR with `request.error` set
        at once and comes back in the finished list of the next `update_from_output`: a duplicate of
        a live request's id (the live one is left alone), no prompt or no resolved max_tokens, a
        prompt longer than max_model_len or than the KV pool, a prompt token outside the vocabulary.
        A resumed request whose outputs already end it (a stop token last, max_tokens reached) is
        finished the same way with that reason and no new token."""
        error = self._never_runs(request)
        ended = RequestStatus.FINISHED_ERROR if error is not None else self._resumed_complete(request)
        if ended is not None:
            request.status = ended
            request.error = error
            self._ended_at_add.append(request)
            return
        self.requests[request.request_id] = request
        self._arrival[request.request_id] = self._next_arrival
        self._next_arrival += 1
        self.waiting.append(request)

    def reject(self, request: Request, error: str) -> None:
        """Refuse a request that never entered the engine; it comes back, FINISHED_ERROR with
        `error`, in the finished list of the next `update_from_output`."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        self._ended_at_add.append(request)

    def _never_runs(self, request: Request) -> str | None:
        if request.request_id in self.requests:
            return f"duplicate request id {request.request_id!r}: a request with that id is already in the engine"
        if request.status != RequestStatus.WAITING:
            return f"request {request.request_id!r} is {request.status.name}, not WAITING"
        if not request.prompt_token_ids:
            return "a request needs at least one prompt token"
        if request.sampling.max_tokens is None:
            return "max_tokens must be resolved before the engine"
        vocab = self.config.vocab_size
        if vocab and not all(0 <= token < vocab for token in request.all_token_ids):
            bad = next(token for token in request.all_token_ids if not 0 <= token < vocab)
            return f"prompt token id {bad} is outside the vocabulary (0..{vocab - 1})"
        if self._resumed_complete(request) is not None:
            return None  # it ends at once: it needs no room
        capacity = self.kv_cache.num_blocks * self.kv_cache.block_size
        # The prompt plus one generated token must fit: a prompt that fills the window can say nothing.
        if request.num_tokens >= self.config.max_model_len:
            return (f"prompt has {request.num_tokens} tokens; max_model_len ({self.config.max_model_len}) "
                    "leaves no room for a completion")
        if request.num_tokens > capacity:
            return f"prompt has {request.num_tokens} tokens, more than the KV cache holds ({capacity})"
        return None

    def _resumed_complete(self, request: Request) -> RequestStatus | None:
        """How a resumed request ends before generating anything: what the engine that sampled its
        last output token would have decided right after it (None: it goes on)."""
        if not request.output_token_ids:
            return None
        return self._check_stop(request, request.output_token_ids[-1])

    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish the given requests as aborted and free their blocks now; unknown ids are ignored."""
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus,
                        error: str | None = None) -> list[Request]:
        """End the given live requests with `status` (and `error`) and free their blocks now;
        unknown ids are ignored. The caller reports them: they are not in any finished list."""
        ended = []
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.error = error
            self._finish(request, status)
            ended.append(request)
        return ended

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preemptions: list[Preemption] = []
        self.waiting = deque(sorted(self.waiting, key=self._waiting_key))
        interactive_waiting = any(self._interactive(r) for r in self.waiting)
        interactive_present = interactive_waiting or any(self._interactive(r) for r in self.running)
        batch_turn = self._batch_turn(interactive_present)
        batch_prompt_left = self.config.batch_prefill_tokens
        batch_tokens_left, in_turn = self._batch_width(interactive_present)
        offered = None if in_turn is None else set(in_turn)
        computed_batch: set[str] = set()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new_tokens = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._interactive(request) and (
                    not batch_turn or (interactive_waiting and num_new_tokens > 1)
                    or (offered is not None and request.request_id not in offered)):
                # Not the batch's turn, or this request's in a narrow step; or a batch prefill
                # chunk while the budget goes to the interactive request waiting.
                index += 1
                continue
            if not self._interactive(request):
                prompt_chunk = num_new_tokens > 1
                num_new_tokens = min(num_new_tokens, batch_tokens_left,
                                     batch_prompt_left if prompt_chunk else 1)
                if num_new_tokens == 0:
                    index += 1  # this step's share of batch tokens (or of batch prompt tokens) is spent
                    continue
                batch_tokens_left -= num_new_tokens
                if prompt_chunk:
                    batch_prompt_left -= num_new_tokens
                computed_batch.add(request.request_id)
            if not self._allocate_or_preempt(request, num_new_tokens, preemptions):
                break  # it was the newest running request, so none is left after it
            scheduled.append(self._scheduled(request, num_new_tokens))
            budget -= num_new_tokens
            index += 1
        # Their turns, in the order they were offered (so a narrow step's turns go round).
        for request_id in in_turn if in_turn is not None else [r.request_id for r in self.running]:
            if request_id in computed_batch:
                self._batch_turns_given += 1
                self._batch_computed_at[request_id] = self._batch_turns_given

        # Right after a preemption for KV the cache is full; admitting now would only thrash.
        kv_full = bool(preemptions)
        while not kv_full and self.waiting and budget > 0:
            request = self.waiting[0]
            batch = not self._interactive(request)
            if batch and (not batch_turn or min(batch_prompt_left, batch_tokens_left) == 0):
                break  # batch work is admitted in its turns, within its share; only batch work is left
            admitted = self._make_room(request, scheduled, preemptions,
                                       min(batch_prompt_left, batch_tokens_left) if batch else None)
            if admitted is None:
                break  # nobody overtakes the head of the queue
            num_hit_tokens, num_new_tokens = admitted
            if batch:
                batch_prompt_left -= num_new_tokens
                batch_tokens_left -= num_new_tokens
                self._batch_turns_given += 1
                self._batch_computed_at[request.request_id] = self._batch_turns_given
            self.waiting.remove(request)  # the requests it preempted went in front of it
            self._front.pop(request.request_id, None)
            if self.state_slots is not None:
                request.state_slot = self.state_slots.allocate(request.request_id)
            request.num_computed_tokens = num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=self._running_key)
            scheduled.append(self._scheduled(request, num_new_tokens))
            budget = self.config.max_num_batched_tokens - sum(i.num_new_tokens for i in scheduled)

        self._age_waiting()
        return SchedulerOutput(
            scheduled=scheduled,
            preempted=[p.request_id for p in preemptions],
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preemptions=preemptions,
        )

    def _make_room(self, request: Request, scheduled: list[ScheduledRequest],
                   preemptions: list[Preemption], max_tokens: int | None = None) -> tuple[int, int] | None:
        """Take a seat, a state slot and the KV blocks for admitting `request`, preempting running
        batch requests (newest first, their chunks unscheduled) when it is interactive work.
        Returns (its prefix-cache hit in tokens, the tokens it computes this step), or None if it
        does not fit."""
        while True:
            has_seat = len(self.running) < self.config.max_num_seqs and (
                self.state_slots is None or self.state_slots.num_free > 0)
            if has_seat:
                computed_blocks, num_hit_tokens = self.kv_cache.get_computed_blocks(request)
                budget = self.config.max_num_batched_tokens - sum(i.num_new_tokens for i in scheduled)
                num_new_tokens = min(request.num_tokens - num_hit_tokens, budget)
                if max_tokens is not None:
                    num_new_tokens = min(num_new_tokens, max_tokens)
                if self.kv_cache.allocate_slots(request, num_new_tokens, computed_blocks):
                    return num_hit_tokens, num_new_tokens
            victim = self.running[-1] if self.running else None
            if not self._interactive(request) or victim is None or self._interactive(victim):
                return None
            self.running.pop()
            scheduled[:] = [item for item in scheduled if item.request is not victim]
            self._preempt(victim, INTERACTIVE_WAITING, preemptions)

    def _batch_width(self, interactive_present: bool) -> tuple[int, list[str] | None]:
        """The batch tokens this step may compute, and (in a narrow step) which running batch
        requests may have them: the least recently computed first, one token each at least."""
        now = self._clock()
        if interactive_present:
            self._interactive_seen_at = now
        if now - self._interactive_seen_at >= self.config.batch_narrow_s:
            return self.config.max_num_batched_tokens, None
        width = self.config.batch_narrow_tokens
        batch = [r.request_id for r in self.running if not self._interactive(r)]
        batch.sort(key=lambda request_id: self._batch_computed_at.get(request_id, 0))
        return width, batch[:width]

    def _batch_turn(self, interactive_present: bool) -> bool:
        """Whether the running batch requests are computed this step (see the module's doc)."""
        if not interactive_present:
            self._steps_since_batch_turn = 0
            return True
        self._steps_since_batch_turn += 1
        if self._steps_since_batch_turn < self.config.batch_step_interval:
            return False
        self._steps_since_batch_turn = 0
        return True

    def _interactive(self, request: Request) -> bool:
        """Admitted and run as interactive work: interactive, or batch that has aged."""
        return request.service_class == ServiceClass.INTERACTIVE or request.request_id in self._aged

    def _waiting_key(self, request: Request) -> tuple[int, int, int, int]:
        rank = 0 if self._interactive(request) else 1
        front = self._front.get(request.request_id)
        if front is not None:
            return rank, 0, -front, 0
        return rank, 1, request.priority, self._arrival[request.request_id]

    def _running_key(self, request: Request) -> tuple[int, int]:
        return 0 if self._interactive(request) else 1, self._arrival[request.request_id]

    def _age_waiting(self) -> None:
        for request in self.waiting:
            request.waiting_steps += 1
            if (request.service_class == ServiceClass.BATCH
                    and request.waiting_steps >= self.config.batch_aging_steps):
                self._aged.add(request.request_id)

    def update_from_output(
        self, output: SchedulerOutput, sampled: dict[str, int]
    ) -> tuple[list[Request], list[Request]]:
        """Advance the step's requests; `sampled` maps request id to the token sampled for every
        scheduled request with `sample` set. Returns (requests that got a new token, requests that
        finished this step, including ones that ended at add time)."""
        with_new_token: list[Request] = []
        finished: list[Request] = self._ended_at_add
        self._ended_at_add = []
        for item in output.scheduled:
            request = item.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted since the step was scheduled
            request.num_computed_tokens += item.num_new_tokens
            self.kv_cache.cache_blocks(request, request.num_computed_tokens)
            if not item.sample:
                continue
            token_id = sampled[request.request_id]
            request.append_output_token(token_id)
            with_new_token.append(request)
            status = self._check_stop(request, token_id)
            if status is not None:
                self._finish(request, status)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
        return with_new_token, finished

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        sampling = request.sampling
        if request.num_output_tokens >= sampling.min_tokens and (
            token_id in sampling.stop_token_ids
            or (not sampling.ignore_eos and token_id in request.eos_token_ids)
        ):
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= sampling.max_tokens or request.num_tokens >= self.max_seq_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int,
                             preemptions: list[Preemption]) -> bool:
        """Preempt the newest running requests until `request` gets its slots; False if that meant
        preempting `request` itself. The running requests before it come first (interactive, then
        older) and are never the ones preempted."""
        while not self.kv_cache.allocate_slots(request, num_new_tokens):
            victim = self.running.pop()
            self._preempt(victim, KV_CACHE_FULL, preemptions)
            if victim is request:
                return False
        return True

    def _scheduled(self, request: Request, num_new_tokens: int) -> ScheduledRequest:
        sample = request.num_computed_tokens + num_new_tokens == request.num_tokens
        return ScheduledRequest(request=request, num_new_tokens=num_new_tokens, sample=sample)

    def _release_state_slot(self, request: Request) -> None:
        if self.state_slots is not None and request.state_slot is not None:
            self.state_slots.free(request.state_slot)
        request.state_slot = None

    def _preempt(self, request: Request, reason: PreemptionReason, preemptions: list[Preemption]) -> None:
        self.kv_cache.free(request)
        self._release_state_slot(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.preemptions_by_reason[reason] += 1
        preemptions.append(Preemption(request.request_id, reason, request.service_class,
                                      request.num_output_tokens))
        self._front[request.request_id] = self._next_front
        self._next_front += 1
        self._batch_computed_at.pop(request.request_id, None)
        self.waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        """Release everything but the running list, which the caller updates."""
        request.status = status
        self.kv_cache.free(request)
        self._release_state_slot(request)
        del self.requests[request.request_id]
        del self._arrival[request.request_id]
        self._front.pop(request.request_id, None)
        self._aged.discard(request.request_id)
        self._batch_computed_at.pop(request.request_id, None)

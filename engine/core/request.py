"""A request's mutable state inside the engine core: tokens, progress, blocks, status. No torch."""

from __future__ import annotations

import enum

from engine.frontend.protocol import FinishReason, SamplingParams, ServiceClass


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED_STOPPED = 2
    FINISHED_LENGTH = 3
    FINISHED_ABORTED = 4
    FINISHED_ERROR = 5

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


class Request:
    """Prompt plus generated tokens; `num_computed_tokens` of them have KV in `block_ids`."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        eos_token_ids: list[int] | None = None,
        resumed_token_ids: list[int] | None = None,
        service_class: ServiceClass = ServiceClass.INTERACTIVE,
        priority: int = 0,
        cache_salt: str = "",
    ) -> None:
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        # A resumed request starts with the outputs it had elsewhere, recomputed like a preempted one's.
        self.output_token_ids: list[int] = list(resumed_token_ids or [])
        self.all_token_ids: list[int] = self.prompt_token_ids + self.output_token_ids
        self.num_resumed_tokens = len(self.output_token_ids)
        self.sampling = sampling
        self.service_class = service_class
        # Lower runs first within the class.
        self.priority = priority
        # Prefix-cache blocks are shared only between requests with the same salt (engine.core.kv_cache).
        self.cache_salt = cache_salt
        # Scheduler steps spent waiting since it last entered the waiting queue (aging).
        self.waiting_steps = 0
        self.eos_token_ids = list(eos_token_ids or [])
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        # Prompt tokens found in the prefix cache when the request was first scheduled.
        self.num_cached_tokens = -1
        # The block table: block ids holding this request's KV, in token order.
        self.block_ids: list[int] = []
        # Hybrid models: the linear-attention state slot held while running (None otherwise).
        self.state_slot: int | None = None
        # Why the request finished with FINISHED_ERROR.
        self.error: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_ids})"
        )

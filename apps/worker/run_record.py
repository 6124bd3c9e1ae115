"""What one run tells its client and the ledger at the end: token counts and timings, filled in
as the run goes, and the `Usage`, `run.started` and `run.finished` made of them."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from apps.bus import event_builders, wire
from apps.bus.codes import RunStatus
from apps.bus.events import RunFinished, RunPreempted, RunStarted
from engine.frontend.protocol import FinishReason, PreemptionReason


def _engine_error(error: str | None) -> str | None:
    """An engine's error as the ledger keeps it: its first line, at most 1 KB. llguidance's runtime
    errors go on with the parser's state and the whole grammar (as large as the client likes)."""
    return None if error is None else wire.bounded_text(error.split("\n", 1)[0])


# run.preempted events one run publishes at most (a thrashing KV cache could preempt it every few steps).
MAX_PREEMPTION_EVENTS = 32


@dataclass(slots=True)
class RunRecord:
    """What the ledger learns about one run, filled in as it goes."""

    request: wire.GenerateRequest
    node: str
    attempt: int
    received_at: float
    # The engine's tensor-parallel ranks, as the ledger's run rows keep them.
    tensor_parallel: int = 1
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    prefill_ms: float = 0.0
    # Tokens the engine computed before the first choice's first token (in `prefill_ms`): the
    # prompt and, for a migrated request, the tokens it resumed after, less what its cache held.
    prefilled_tokens: int = 0
    reasoning_tokens: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    # The engine's preemptions of this run's sequences, as run.preempted events to publish.
    preemptions: list[RunPreempted] = field(default_factory=list)

    @property
    def queue_ms(self) -> float:
        return max(self.received_at - self.request.created_at, 0.0) * 1000.0

    def usage(self) -> wire.Usage:
        decode_ms = ((self.finished_at or time.time()) - self.first_token_at) * 1000.0 if self.first_token_at else 0.0
        return wire.Usage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens,
            queue_ms=round(self.queue_ms, 3),
            prefill_ms=round(self.prefill_ms, 3),
            decode_ms=round(decode_ms, 3),
            reasoning_tokens=self.reasoning_tokens,
        )

    def preempted(self, reason: PreemptionReason, tokens_kept: int) -> None:
        if len(self.preemptions) >= MAX_PREEMPTION_EVENTS:
            return
        self.preemptions.append(RunPreempted(
            model=self.request.model, node=self.node, request_id=self.request.request_id, reason=reason,
            service_class=self.request.service_class, tokens_kept=tokens_kept))

    def started_event(self) -> RunStarted:
        return RunStarted(
            model=self.request.model,
            node=self.node,
            request_id=self.request.request_id,
            api=self.request.api,
            principal=self.request.principal,
            prompt_tokens=self.prompt_tokens,
            attempt=self.attempt,
            queue_ms=round(self.queue_ms, 3),
            tensor_parallel=self.tensor_parallel,
        )

    def finished_event(self, status: RunStatus, finish_reason: FinishReason,
                       error: str | None = None, served: bool = True) -> RunFinished:
        usage = self.usage()
        ttft = (self.first_token_at - self.request.created_at) * 1000.0 if self.first_token_at else None
        return event_builders.run_finished(
            self.request, node=self.node, attempt=self.attempt, status=status, finish_reason=finish_reason,
            error=_engine_error(error), served=served, prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens, cached_tokens=self.cached_tokens,
            reasoning_tokens=self.reasoning_tokens, queue_ms=usage.queue_ms,
            ttft_ms=round(ttft, 3) if ttft is not None else None, prefill_ms=usage.prefill_ms,
            decode_ms=usage.decode_ms, ended_at=self.finished_at, tensor_parallel=self.tensor_parallel,
        )

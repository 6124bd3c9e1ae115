"""One builder per event kind published from more than one place, so every publisher fills the
fields it shares with the others the same way.

`run.finished` is the workers' own, but a gateway publishes it for a run whose worker died serving
it (`apps.gateway.migration`); `admission` is the gateways' own, but a worker publishes it for a
request it drops because nobody waits for it any more (`apps.worker.model_loop`).
"""

from __future__ import annotations

import time

from apps.bus import wire
from apps.bus.codes import FinishReason, RunStatus
from apps.bus.events import AdmissionDecided, AdmissionDecision, RunFinished

# The `node` of the admission events a gateway publishes (admission is not a node's decision).
GATEWAY_NODE = "gateway"


def run_finished(request: wire.GenerateRequest, *, node: str, attempt: int, status: RunStatus,
                 finish_reason: FinishReason, error: str | None = None, served: bool | None = None,
                 prompt_tokens: int = 0, completion_tokens: int = 0, cached_tokens: int = 0,
                 reasoning_tokens: int = 0, queue_ms: float = 0.0, ttft_ms: float | None = None,
                 prefill_ms: float = 0.0, decode_ms: float = 0.0, ended_at: float | None = None,
                 tensor_parallel: int | None = None) -> RunFinished:
    """`request`'s run ended on `node` at `ended_at` (now by default); the counts and timings a
    publisher does not know stay at zero."""
    end = time.time() if ended_at is None else ended_at
    return RunFinished(
        model=request.model, node=node, request_id=request.request_id, api=request.api,
        principal=request.principal, status=status, finish_reason=finish_reason, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, cached_tokens=cached_tokens, attempt=attempt, queue_ms=queue_ms,
        ttft_ms=ttft_ms, prefill_ms=prefill_ms, decode_ms=decode_ms,
        e2e_ms=round((end - request.created_at) * 1000.0, 3), error=error, reasoning_tokens=reasoning_tokens,
        served=served, tensor_parallel=tensor_parallel,
    )


def admission_decided(model: str, request_id: str, principal: str | None, decision: AdmissionDecision, *,
                      pending: int, in_flight: int, node: str = GATEWAY_NODE, detail: str | None = None,
                      retry_after_s: float | None = None, waited_ms: float = 0.0) -> AdmissionDecided:
    """How one request was admitted (or refused, or dropped) and the counters at that moment."""
    return AdmissionDecided(
        model=model, node=node, request_id=request_id, principal=principal, decision=decision, detail=detail,
        pending=pending, in_flight=in_flight, retry_after_s=retry_after_s, waited_ms=waited_ms,
    )

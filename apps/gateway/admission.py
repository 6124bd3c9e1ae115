"""Admission control per model at the gateway (SPEC §5): shed early and fairly, never leak a slot.

- QueueFull (503) when pending ≥ max_in_flight + max_queue_depth;
- PrincipalCap (429) when the principal already holds max_per_principal slots (anonymous exempt);
- otherwise reserve, wait up to max_wait_s for an in-flight slot (FIFO), else Timeout (503).
The reservation is released however the wait or the request ends: admitted and finished, timed out,
or the caller cancelled while queued. Zero for a limit means "off".

Where each check lives: this gateway enforces queue depth, the per-principal cap and its own share
of in-flight requests; workers enforce their real capacity by pulling only what fits their slots.
With several gateway replicas, give each `max_in_flight` ≈ fleet slots ÷ replicas.

`Admission` is the algorithm for one model; `Admissions` holds one per model, answers a request
with a `Ticket` or a `ServingError`, and emits every decision as an event. Nothing is awaited
between taking a reservation and handing its ticket over (events go out in the background), so
no cancellation can fall in between and strand a slot.
"""

from __future__ import annotations

import asyncio
import time
import tomllib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from apps.bus import event_builders, wire
from apps.bus.codes import ErrorCode, ServingError, retry_after_s
from apps.bus.events import AdmissionDecided, AdmissionDecision, AnyEvent
from apps.gateway.metrics import GatewayMetrics


@dataclass(slots=True, frozen=True)
class AdmissionLimits:
    max_in_flight: int = 0
    max_queue_depth: int = 0
    max_wait_s: float = 60.0
    max_per_principal: int = 0

    def __post_init__(self) -> None:
        if min(self.max_in_flight, self.max_queue_depth, self.max_per_principal) < 0 or self.max_wait_s <= 0:
            raise ValueError("admission limits must be >= 0 and max_wait_s > 0")


def load_per_model(path: str | Path, defaults: AdmissionLimits) -> dict[str, AdmissionLimits]:
    """Per-model limits from TOML (`[models."id"]` tables); fields left out keep the defaults."""
    with open(path, "rb") as f:
        document = tomllib.load(f)
    allowed = {f.name for f in fields(AdmissionLimits)}
    per_model = {}
    for model, table in document.get("models", {}).items():
        unknown = set(table) - allowed
        if unknown:
            raise ValueError(f"{path}: unknown admission settings for {model!r}: {sorted(unknown)}")
        per_model[model] = replace(defaults, **table)
    return per_model


class Rejected(Exception):
    def __init__(self, decision: AdmissionDecision, status: int, retry_after: int, pending: int,
                 in_flight: int) -> None:
        super().__init__(decision)
        self.decision, self.status, self.retry_after = decision, status, retry_after
        self.pending, self.in_flight = pending, in_flight


class Ticket:
    """One admitted request's hold on `weight` slots; `release` is idempotent."""

    def __init__(self, admission: Admission, principal: str | None, waited_ms: float, weight: int = 1) -> None:
        self._admission = admission
        self.principal = principal
        self.waited_ms = waited_ms
        self.weight = weight
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._finish_in_flight(self.weight)
            self._admission._unreserve(self.principal, self.weight)


class Admission:
    """Slots for one model. A request weighs as many slots as it has choices (`n`): each choice is
    a sequence in a worker's batch. A request heavier than a limit weighs that limit (it takes all
    of it), so it waits for the model to be free rather than never being admitted."""

    def __init__(self, limits: AdmissionLimits) -> None:
        self.limits = limits
        self.pending = 0  # in flight + queued, in slots
        self.in_flight = 0
        self.by_principal: dict[str, int] = {}
        self._queue: deque[tuple[asyncio.Future[None], int]] = deque()

    def _reject(self, decision: AdmissionDecision, status: int) -> Rejected:
        hint = retry_after_s(max(self.pending - self.limits.max_in_flight, 0))
        return Rejected(decision, status, hint, self.pending, self.in_flight)

    def _weigh(self, principal: str | None, weight: int) -> int:
        limits = self.limits
        caps = [limits.max_in_flight or weight, weight]
        if principal is not None and limits.max_per_principal:
            caps.append(limits.max_per_principal)
        return max(min(caps), 1)

    async def acquire(self, principal: str | None, weight: int = 1) -> Ticket:
        limits = self.limits
        weight = self._weigh(principal, weight)
        if limits.max_in_flight and self.pending + weight > limits.max_in_flight + limits.max_queue_depth:
            raise self._reject(AdmissionDecision.QUEUE_FULL, 503)
        if principal is not None and limits.max_per_principal and \
                self.by_principal.get(principal, 0) + weight > limits.max_per_principal:
            raise self._reject(AdmissionDecision.PRINCIPAL_CAP, 429)
        self.pending += weight
        if principal is not None:
            self.by_principal[principal] = self.by_principal.get(principal, 0) + weight
        started = time.monotonic()
        try:
            if not limits.max_in_flight or (self.in_flight + weight <= limits.max_in_flight and not self._queue):
                self.in_flight += weight
            else:
                await self._wait_for_slot(weight, limits.max_wait_s)
        except BaseException:
            self._unreserve(principal, weight)
            raise
        return Ticket(self, principal, (time.monotonic() - started) * 1000.0, weight)

    async def _wait_for_slot(self, weight: int, timeout_s: float) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (waiter, weight)
        self._queue.append(entry)
        try:
            await asyncio.wait_for(waiter, timeout_s)
        except BaseException as exc:
            if waiter.done() and not waiter.cancelled():
                # Slots were handed over just as we gave up: pass them on rather than leak them.
                self._finish_in_flight(weight)
            elif entry in self._queue:
                self._queue.remove(entry)
                # The head may have been waiting behind us only: let what fits now go.
                self._hand_over()
            if isinstance(exc, TimeoutError):
                raise self._reject(AdmissionDecision.TIMEOUT, 503) from None
            raise

    def _unreserve(self, principal: str | None, weight: int) -> None:
        self.pending -= weight
        if principal is not None:
            left = self.by_principal.get(principal, weight) - weight
            if left > 0:
                self.by_principal[principal] = left
            else:
                self.by_principal.pop(principal, None)

    def _finish_in_flight(self, weight: int) -> None:
        self.in_flight -= weight
        self._hand_over()

    def _hand_over(self) -> None:
        """Give freed slots to the queue's head, in order (a newcomer cannot jump the queue)."""
        while self._queue:
            waiter, weight = self._queue[0]
            if waiter.done():
                self._queue.popleft()
                continue
            if self.limits.max_in_flight and self.in_flight + weight > self.limits.max_in_flight:
                return
            self._queue.popleft()
            self.in_flight += weight
            waiter.set_result(None)


_REFUSALS = {
    AdmissionDecision.QUEUE_FULL: ("The model's queue is full; retry later.", ErrorCode.QUEUE_FULL),
    AdmissionDecision.PRINCIPAL_CAP: ("Too many concurrent requests for this API key; retry later.",
                                      ErrorCode.RATE_LIMIT_EXCEEDED),
    AdmissionDecision.TIMEOUT: ("The model is busy and the request waited too long; retry later.",
                                ErrorCode.QUEUE_TIMEOUT),
}


class Admissions:
    """This gateway's admission control: one `Admission` per model, with its own limits if
    configured; every decision is emitted (`emit` never blocks) and refusals are counted.

    Generations are admitted by `admit`. The calls that cost work but generate nothing (token
    counts, stored responses read or deleted) are admitted by `admit_call`, each kind in a pool of
    its own under the same limits, so that a count never waits behind a long generation while
    a flood of counts still queues, sheds and is capped per principal like generations are."""

    def __init__(self, defaults: AdmissionLimits, per_model: dict[str, AdmissionLimits] | None,
                 metrics: GatewayMetrics, emit: Callable[[AnyEvent], None]) -> None:
        self._defaults = defaults
        self._per_model = per_model or {}
        self._metrics = metrics
        self._emit = emit
        self.by_model: dict[str, Admission] = {}
        self.by_call: dict[tuple[str, str], Admission] = {}

    def for_model(self, model: str) -> Admission:
        if model not in self.by_model:
            self.by_model[model] = Admission(self._per_model.get(model, self._defaults))
        return self.by_model[model]

    def for_call(self, kind: str, model: str) -> Admission:
        if (kind, model) not in self.by_call:
            self.by_call[kind, model] = Admission(self._per_model.get(model, self._defaults))
        return self.by_call[kind, model]

    async def admit(self, request: wire.GenerateRequest) -> Ticket:
        """Take the request's admission slots (one per choice), or refuse it (429/503 with Retry-After)."""
        return await self._admit(self.for_model(request.model), request.model, request.request_id,
                                 request.principal, request.sampling.n)

    async def admit_call(self, kind: str, model: str, request_id: str, principal: str | None) -> Ticket:
        """One slot of `kind` calls (`tokenize`, `responses.get`, ...) for `model` (`-`: none), or a
        refusal as for generations; the decision's event says the kind in `detail`."""
        return await self._admit(self.for_call(kind, model), model, request_id, principal, 1, kind)

    async def _admit(self, admission: Admission, model: str, request_id: str, principal: str | None,
                     weight: int, kind: str | None = None) -> Ticket:
        def decided(decision: AdmissionDecision, pending: int, in_flight: int, retry_after_s: float | None = None,
                    waited_ms: float = 0.0) -> AdmissionDecided:
            return event_builders.admission_decided(model, request_id, principal, decision, pending=pending,
                                                    in_flight=in_flight, detail=kind, retry_after_s=retry_after_s,
                                                    waited_ms=waited_ms)

        try:
            ticket = await admission.acquire(principal, weight)
        except Rejected as exc:
            self._metrics.rejections.labels(model, exc.decision).inc()
            self._emit(decided(exc.decision, pending=exc.pending, in_flight=exc.in_flight,
                               retry_after_s=exc.retry_after))
            message, code = _REFUSALS[exc.decision]
            raise ServingError(
                exc.status,
                code,
                message,
                retry_after_s=exc.retry_after,
                context={"model": model, "request_id": request_id, "detail": exc.decision},
            ) from None
        except asyncio.CancelledError:
            self._emit(decided(AdmissionDecision.CANCELLED, pending=admission.pending, in_flight=admission.in_flight))
            raise
        self._emit(decided(AdmissionDecision.ADMITTED, pending=admission.pending, in_flight=admission.in_flight,
                           waited_ms=round(ticket.waited_ms, 3)))
        return ticket

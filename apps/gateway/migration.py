"""Request migration (runs in the gateway process): a stream whose worker was lost mid-answer goes
on from another worker. The generation lifecycle (`apps.gateway.generation`) asks `Migrator`
whether an error may migrate and has it publish the next attempt.

The gateway keeps, per choice, the token ids of every delta its client was sent (`Delivered`).
When the worker serving the answer is lost after sending text (it went silent past the idle
timeout, stopped, aborted on its own, or frames went missing), the request is published again as
a new message (`migrated`): its `attempt` is past every attempt the old message can reach, so
the old worker, if it still runs, learns from its next alive probe that it lost; `resume` names
what each choice's client already has, and the new worker prefills the prompt and those tokens
and continues without sending any of it again. The client sees one stream, whose usage counts the
whole answer; the ledger has a row for each attempt. `HELEXA_MAX_MIGRATIONS` bounds how often one
request moves (then the client gets the error, as with the limit at 0).

A worker that died serving a run cannot report it: the gateway records it in the ledger itself
(`record_lost_run`, under `worker_lost`: run events are the workers' own).
"""

from __future__ import annotations

import logging
import time

import msgspec
import nats.errors

from apps.bus import event_builders, topology, wire
from apps.bus.codes import ErrorCode, FinishReason, RunStatus, ServingError
from apps.gateway.bus_client import GatewayBus
from apps.gateway.events import EventPublisher
from apps.gateway.generation_metrics import GenerationMetrics
from apps.gateway.reply_stream import ReplyStream
from apps.settings import GatewaySettings

log = logging.getLogger("helexa.gateway")

# The failures after which the answer can go on elsewhere: the worker, not the request, failed.
MIGRATABLE = frozenset({ErrorCode.WORKER_LOST, ErrorCode.WORKER_STOPPING, ErrorCode.FRAMES_LOST,
                        ErrorCode.ENGINE_LOST})
# Failures where the worker is gone and cannot report the run itself (`Migrator.record_lost_run`).
LOST = (ErrorCode.WORKER_LOST, ErrorCode.DELIVERY_FAILED)


class Delivered:
    """What one request's client has been sent, per choice."""

    def __init__(self, num_choices: int) -> None:
        self._token_ids: list[list[int]] = [[] for _ in range(num_choices)]
        self._finish: list[FinishReason | None] = [None] * num_choices

    def add(self, delta: wire.Delta) -> None:
        if 0 <= delta.index < len(self._token_ids):
            self._token_ids[delta.index].extend(delta.token_ids)
            if delta.finish_reason is not None:
                self._finish[delta.index] = delta.finish_reason

    def resume(self) -> list[wire.ResumedChoice]:
        return [wire.ResumedChoice(token_ids=list(ids), finish_reason=finish)
                for ids, finish in zip(self._token_ids, self._finish, strict=True)]


def migrated(request: wire.GenerateRequest, delivered: Delivered, max_deliver: int) -> wire.GenerateRequest:
    """The next attempt of `request`: numbered past every delivery of its current message."""
    return msgspec.structs.replace(request, attempt=request.attempt + max_deliver, resume=delivered.resume(),
                                   arriving=0)


class Migrator:
    """One gateway's migrations, and the ledger rows of the runs lost on the way."""

    def __init__(self, bus: GatewayBus, events: EventPublisher, metrics: GenerationMetrics,
                 settings: GatewaySettings) -> None:
        self._bus = bus
        self._events = events
        self._metrics = metrics
        self._settings = settings

    def may_migrate(self, error: ServingError, reply: ReplyStream, migrations: int) -> bool:
        if error.code not in MIGRATABLE or migrations >= self._settings.max_migrations:
            return False
        # Silence before any delta past the deadline is a request nobody took, not a lost worker.
        return error.code != ErrorCode.WORKER_LOST or reply.locked_attempt is not None

    async def migrate(self, lost: wire.GenerateRequest, reply: ReplyStream, node: str, prompt_tokens: int,
                      delivered: Delivered, error: ServingError, completion_tokens: int) -> wire.GenerateRequest:
        """Publish the request's next attempt from what the client has, and return it; re-raise
        `error` if it cannot be published."""
        lost_attempt = reply.attempt
        request = msgspec.structs.replace(migrated(lost, delivered, self._bus.limits.max_deliver),
                                          deadline=time.time() + self._settings.accept_timeout_s)
        log.warning("migrating a request: its worker was lost mid-answer",
                    extra={"request_id": lost.request_id, "node": node, "error": error.code,
                           "attempt": lost_attempt, "next_attempt": request.attempt})
        try:
            request = await self._bus.resubmit(reply, request)
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("migration failed", extra={"request_id": lost.request_id, "error": repr(exc)})
            raise error from None
        self._metrics.migrated(lost.model, error.code)
        if error.code == ErrorCode.WORKER_LOST:  # a silent worker cannot report the run itself
            self.record_lost_run(lost, node, lost_attempt, error.code, prompt_tokens, completion_tokens,
                                 served=False)
        return request

    def record_lost_run(self, request: wire.GenerateRequest, node: str, attempt: int, error: str,
                        prompt_tokens: int = 0, completion_tokens: int = 0, served: bool | None = None) -> None:
        """The ledger's RunFinished for a run no worker can report: it died serving it (under
        `worker_lost`: run events are the workers' own)."""
        self._events.emit(event_builders.run_finished(
            request, node=node, attempt=max(attempt, 1), status=RunStatus.ERROR, finish_reason=FinishReason.ERROR,
            error=error, served=served, prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
        ), subject_kind=topology.WORKER_LOST)

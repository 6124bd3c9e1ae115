"""Request migration: a stream whose worker was lost mid-answer goes on from another worker.

The gateway keeps, per choice, the token ids of every delta its client was sent (`Delivered`).
When the worker serving the answer is lost after sending text (it went silent past the idle
timeout, stopped, aborted on its own, or frames went missing), the request is published again as
a new message (`migrated`): its `attempt` is past every attempt the old message can reach, so
the old worker, if it still runs, learns from its next alive probe that it lost; `resume` names
what each choice's client already has, and the new worker prefills the prompt and those tokens
and continues without sending any of it again. The client sees one stream, whose usage counts the
whole answer; the ledger has a row for each attempt. `HELEXA_MAX_MIGRATIONS` bounds how often one
request moves (then the client gets the error, as with the limit at 0).
"""

from __future__ import annotations

import msgspec

from apps.bus import wire
from apps.bus.codes import ErrorCode, FinishReason

# The failures after which the answer can go on elsewhere: the worker, not the request, failed.
MIGRATABLE = frozenset({ErrorCode.WORKER_LOST, ErrorCode.WORKER_STOPPING, ErrorCode.FRAMES_LOST,
                        ErrorCode.ENGINE_LOST})


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

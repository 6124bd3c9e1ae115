"""The vocabulary every app shares: run statuses, error codes, node and model states, and the one
error type a request fails with, `(status, code, message)`; every 503 is built by `unavailable`
from its `Unavailable` reason.

Finish reasons are the engine's (`engine.frontend.protocol.FinishReason`, re-exported here). Every enum is
a `StrEnum`, so it is its own JSON string on the bus and in the ledger.
"""

from __future__ import annotations

import enum
from typing import Any

from engine.frontend.protocol import FinishReason

__all__ = ["Api", "ErrorCode", "FinishReason", "ModelState", "NodeState", "RunStatus", "ServingError", "Unavailable",
           "retry_after_s", "unavailable"]


class Api(enum.StrEnum):
    """Which client API a request came through (`runs.api`)."""

    CHAT_COMPLETIONS = "chat.completions"
    COMPLETIONS = "completions"
    MESSAGES = "messages"
    RESPONSES = "responses"


class RunStatus(enum.StrEnum):
    """How a run ended, as the ledger's `runs.status` records it."""

    OK = "ok"
    CANCELLED = "cancelled"
    ERROR = "error"
    # Refused before generating (the prompt did not fit, the model was poisoned, ...).
    REJECTED = "rejected"


class ErrorCode(enum.StrEnum):
    """The `code` of an error answer (OpenAI envelope) and of a worker's error frame."""

    INVALID_REQUEST = "invalid_request"
    INVALID_JSON = "invalid_json"
    INVALID_PROMPT = "invalid_prompt"
    INVALID_MESSAGES = "invalid_messages"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    MISSING_API_KEY = "missing_api_key"
    INVALID_API_KEY = "invalid_api_key"
    MODEL_NOT_FOUND = "model_not_found"
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    QUEUE_FULL = "queue_full"
    QUEUE_TIMEOUT = "queue_timeout"
    MODEL_UNAVAILABLE = "model_unavailable"
    MODEL_LOADING = "model_loading"
    MODEL_POISONED = "model_poisoned"
    BUS_UNAVAILABLE = "bus_unavailable"
    # The worker serving a request went silent mid-answer.
    WORKER_LOST = "worker_lost"
    # Reply frames of the attempt serving a stream went missing or came twice (sequence gap):
    # text may be lost, so the stream ends with this error unless it could be migrated.
    FRAMES_LOST = "frames_lost"
    # Every delivery's worker died holding the request: it will not be tried again.
    DELIVERY_FAILED = "delivery_failed"
    GENERATION_FAILED = "generation_failed"
    # The worker was stopped (SIGTERM) while this stream ran past its grace: the answer is cut
    # short; a requester may migrate it.
    WORKER_STOPPING = "worker_stopping"
    # The engine core process serving this request died (not a device fault): the worker starts it
    # again; the answer is cut short, and a requester may migrate it.
    ENGINE_LOST = "engine_lost"
    # The gateway was stopped (SIGTERM, Ctrl-C on `helexa up`) while this answer ran past its
    # grace: the answer is cut short, and nothing goes on with it.
    GATEWAY_STOPPING = "gateway_stopping"
    # Another attempt of the request serves its client; this one stopped (the ledger's `error`).
    ATTEMPT_TAKEN = "attempt_taken"
    DEVICE_FAULT = "device_fault"
    # A frame of the answer was larger than the bus carries: the client got an error in its place
    # (`generation_failed`); the ledger's `error` says why.
    REPLY_TOO_LARGE = "reply_too_large"
    CLIENT_CLOSED = "client_closed"
    INTERNAL_ERROR = "internal_error"
    # The body is not JSON (415): what a web page can send cross-site without a preflight.
    UNSUPPORTED_MEDIA_TYPE = "unsupported_media_type"
    # The HTTP body is over the gateway's limit (HELEXA_MAX_REQUEST_BYTES): a 413.
    REQUEST_TOO_LARGE = "request_too_large"
    # A streaming client read so slowly that its frames filled the gateway's bounded buffer.
    CLIENT_TOO_SLOW = "client_too_slow"
    # A grammar (structured output, enforced tool calls) that did not compile within its deadline.
    GRAMMAR_TOO_COMPLEX = "grammar_too_complex"
    # A stored response (`previous_response_id`, GET /v1/responses/{id}) that does not exist here.
    RESPONSE_NOT_FOUND = "response_not_found"
    # An uploaded file (/v1/files/{id}) that does not exist here, was deleted, or is another's.
    FILE_NOT_FOUND = "file_not_found"
    BATCH_NOT_FOUND = "batch_not_found"
    # PostgreSQL, where stored responses are read back from, cannot be reached.
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    # EVENTS is (nearly) full of events not yet recorded: new requests wait until the recorder
    # catches up rather than any event being dropped (a 503 with Retry-After).
    EVENTS_FULL = "events_full"
    # The files bucket is at HELEXA_FILES_MAX_BYTES: nothing more is stored until files are deleted.
    FILES_FULL = "files_full"


class NodeState(enum.StrEnum):
    """A worker's `NodeStatus.status`; `degraded` is only ever recorded (some model not ready)."""

    READY = "ready"
    DEGRADED = "degraded"
    STOPPING = "stopping"


class ModelState(enum.StrEnum):
    READY = "ready"
    # After a device fault: requests fail fast until the model is reloaded.
    POISONED = "poisoned"


class ServingError(Exception):
    """A request's own failure, answered to its client as-is: HTTP status, error code, message,
    and where it applies the parameter at fault and a `Retry-After` hint. `context` (model,
    request_id, node, detail) goes to the one warning the failure logs, never to the client."""

    def __init__(
        self,
        status: int,
        code: ErrorCode | None,
        message: str,
        *,
        param: str | None = None,
        retry_after_s: int | None = None,
        context: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s
        self.context = context or {}

    def __reduce__(self) -> tuple[Any, ...]:
        # Raised in a worker's tokenizing process, it crosses back whole.
        return (type(self), (self.status, self.code, self.message), self.__dict__)


def retry_after_s(pending: int = 0) -> int:
    """The back-off hint of SPEC §5: clamp((pending + 1) × 2, 1, 120) seconds."""
    return max(1, min(120, (max(pending, 0) + 1) * 2))


class Unavailable(enum.Enum):
    """Why a request is answered 503: its error code, its message (a `str.format` template) and
    the `Retry-After` it carries (None: none)."""

    QUEUE_FULL = (ErrorCode.QUEUE_FULL, "The request queue is full; retry shortly.", retry_after_s())
    BUS_UNAVAILABLE = (ErrorCode.BUS_UNAVAILABLE,
                       "The request could not be queued (the message bus is unavailable); retry shortly.",
                       retry_after_s())
    BUS_LOST = (ErrorCode.BUS_UNAVAILABLE,
                "The gateway lost its connection to the message bus; retry shortly.", 2)
    QUEUE_TIMEOUT = (ErrorCode.QUEUE_TIMEOUT,
                     "The model is busy and the request was not started in time; retry later.", retry_after_s())
    # The worker ended the answer on its own (`abort`), or went silent mid-answer.
    WORKER_ABORTED = (ErrorCode.WORKER_LOST,
                      "The worker serving this request stopped before the answer was complete.", None)
    WORKER_SILENT = (ErrorCode.WORKER_LOST, "The worker serving this request stopped responding.", None)
    MODEL_POISONED = (ErrorCode.MODEL_POISONED,
                      "The model '{model}' is out of service after a device fault on every worker serving it; "
                      "it answers again once reloaded (helexa models load {model}).", retry_after_s())
    NO_WORKER = (ErrorCode.MODEL_UNAVAILABLE, "No worker is serving the model '{model}' right now; retry later.",
                 retry_after_s())
    MODEL_LOADING = (ErrorCode.MODEL_LOADING, "The model '{model}' is being loaded; retry shortly.", retry_after_s())
    LOAD_FAILED = (ErrorCode.MODEL_UNAVAILABLE, "The model '{model}' could not be loaded: {error}", retry_after_s())
    TOKENIZE_UNANSWERED = (ErrorCode.MODEL_UNAVAILABLE,
                           "No worker serving the model '{model}' answered; retry shortly.", retry_after_s())
    GATEWAY_GRAMMARS_BUSY = (ErrorCode.MODEL_UNAVAILABLE,
                             "The gateway is too busy checking grammars; retry shortly.", retry_after_s())
    WORKER_GRAMMARS_BUSY = (ErrorCode.MODEL_UNAVAILABLE, "The worker is too busy to check grammars: {error}.", None)
    CANNOT_LOAD = (ErrorCode.MODEL_UNAVAILABLE, "this worker cannot load models", None)
    NO_MEMORY = (ErrorCode.MODEL_UNAVAILABLE,
                 "the model '{model}' needs {needed_mb} MB; this worker has {free_mb} MB free", None)
    LEDGER_UNAVAILABLE = (ErrorCode.LEDGER_UNAVAILABLE,
                          "The ledger (stored responses, files and batches) cannot be read right now; retry shortly.",
                          retry_after_s())
    # EVENTS near its limit: about how long the recorder takes to trim what it recorded.
    EVENTS_FULL = (ErrorCode.EVENTS_FULL, "The event ledger is full of events not yet recorded; retry shortly.", 5)
    FILES_FULL = (ErrorCode.FILES_FULL, "The file store is full; no file is stored until some are deleted.", 60)
    GATEWAY_STOPPING = (ErrorCode.GATEWAY_STOPPING,
                        "The server is stopping; the answer was cut short. Retry shortly.", 2)

    def __init__(self, code: ErrorCode, template: str, retry_after_s: int | None) -> None:
        self.code = code
        self.template = template
        self.retry_after_s = retry_after_s


def unavailable(reason: Unavailable, context: dict[str, Any] | None = None, **fields: object) -> ServingError:
    """The 503 for `reason`, its message filled from `fields`; `context` goes to the log only."""
    return ServingError(503, reason.code, reason.template.format(**fields), retry_after_s=reason.retry_after_s,
                        context=context)

"""The vocabulary every app shares: run statuses, error codes, node and model states, and the one
error type a request fails with, `(status, code, message)`.

Finish reasons are the engine's (`engine.protocol.FinishReason`, re-exported here). Every enum is
a `StrEnum`, so it is its own JSON string on the bus and in the ledger.
"""

from __future__ import annotations

import enum
from typing import Any

from engine.protocol import FinishReason

__all__ = ["Api", "ErrorCode", "FinishReason", "ModelState", "NodeState", "RunStatus", "ServingError"]


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
    # PostgreSQL, where stored responses are read back from, cannot be reached.
    LEDGER_UNAVAILABLE = "ledger_unavailable"
    # EVENTS is (nearly) full of events not yet recorded: new requests wait until the recorder
    # catches up rather than any event being dropped (a 503 with Retry-After).
    EVENTS_FULL = "events_full"


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

"""Events on the bus: what happened (a run, an admission, a node's status, a stored response, file or
batch), published on EVENTS and projected by the recorder into the ledger, as JSON msgspec Structs.

Importing this module must stay cheap: no torch, no NATS client. The request and reply-frame
structs they speak of live in `apps.bus.wire`; the builders that fill them in `apps.bus.event_builders`.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from apps.bus.codes import Api, FinishReason, NodeState, RunStatus
from apps.bus.uuid7 import uuid7_hex
from apps.bus.wire import Wire
from engine.frontend.protocol import PreemptionReason, ServiceClass


class Event(Wire, tag_field="kind", frozen=True, kw_only=True):
    """Something that happened, published on EVENTS; `event_id` makes replays idempotent. It is a
    UUIDv7 (hex), so ids sort by creation time and the ledger's primary key grows append-only."""

    event_id: str = msgspec.field(default_factory=uuid7_hex)
    ts: float = msgspec.field(default_factory=time.time)
    model: str
    node: str


class RunStarted(Event, tag="run.started", frozen=True, kw_only=True):
    request_id: str
    api: Api
    principal: str | None
    prompt_tokens: int
    attempt: int
    queue_ms: float
    # Tensor-parallel ranks the model runs on (None: not said).
    tensor_parallel: int | None = None


class RunPreempted(Event, tag="run.preempted", frozen=True, kw_only=True):
    """The engine took a running sequence of this request off its KV cache (engine.core.scheduler):
    `reason` is `interactive_waiting` (a batch sequence gave way to interactive work) or
    `kv_cache_full`; its `tokens_kept` generated tokens are recomputed when it runs again."""

    request_id: str
    reason: PreemptionReason
    service_class: ServiceClass
    tokens_kept: int


class RunFinished(Event, tag="run.finished", frozen=True, kw_only=True):
    request_id: str
    api: Api
    principal: str | None
    status: RunStatus
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    attempt: int
    queue_ms: float
    ttft_ms: float | None
    prefill_ms: float
    decode_ms: float
    e2e_ms: float
    error: str | None = None
    # Tensor-parallel ranks the run was served on (None: not said, e.g. a gateway's for a dead worker).
    tensor_parallel: int | None = None
    reasoning_tokens: int = 0
    # Whether the client's answer came from this attempt (it ended the client's stream): True for
    # the attempt that served, False for one that lost to another attempt, None when the publisher
    # does not know. The ledger's `runs` row follows the served attempt.
    served: bool | None = None



class AdmissionDecision(enum.StrEnum):
    ADMITTED = "admitted"
    QUEUE_FULL = "queue_full"
    PRINCIPAL_CAP = "principal_cap"
    TIMEOUT = "timeout"
    CONTEXT_EXCEEDED = "context_exceeded"
    CANCELLED = "cancelled"


class AdmissionDecided(Event, tag="admission", frozen=True, kw_only=True):
    """How admission control answered one request; `pending`/`in_flight` are the counters at that moment."""

    request_id: str
    principal: str | None
    decision: AdmissionDecision
    detail: str | None = None
    pending: int
    in_flight: int
    retry_after_s: float | None = None
    waited_ms: float = 0.0


class NodeStatusChanged(Event, tag="node.status", frozen=True, kw_only=True):
    """A worker's status when it changes (the `helexa_nodes` bucket holds the live copy); `model` is its main one."""

    status: NodeState
    version: str
    models: list[str]
    slots: int
    free_slots: int
    kv_usage: float | None = None


class BenchRunRecorded(Event, tag="bench.run", frozen=True, kw_only=True):
    """One bench measurement: one target, model and scenario; `run_id` is what scores refer to."""

    run_id: str
    target: str
    scenario: str
    config: dict[str, Any] = {}
    started_at: float
    finished_at: float
    results: dict[str, Any] = {}


class ScoreRecorded(Event, tag="bench.score", frozen=True, kw_only=True):
    """A number attached to a bench run: a measured metric, or a quality score given later."""

    run_id: str
    scenario: str
    metric: str
    value: float
    unit: str | None = None
    scorer: str


class ResponseStored(Event, tag="response.stored", frozen=True, kw_only=True):
    """A Responses API answer kept for later (`store`): the ledger serves it back to
    `previous_response_id` and `GET /v1/responses/{id}`, to its principal only."""

    response_id: str
    principal: str | None
    previous_response_id: str | None = None
    # This request's own input items; the earlier turns are in the responses it follows.
    input_items: list[dict[str, Any]] = []
    # The response object as its client got it (its `output` holds the output items).
    response: dict[str, Any] = {}


class ResponseDeleted(Event, tag="response.deleted", frozen=True, kw_only=True):
    """`DELETE /v1/responses/{id}`: the recorder erases the stored response's content (its row's
    columns, its response.stored payloads in `events`, its messages on EVENTS)."""

    response_id: str
    principal: str | None


class FileCreated(Event, tag="file.created", frozen=True, kw_only=True):
    """`POST /v1/files`: a file's content is object `file_id` of the `helexa_files` bucket; the
    ledger's `files` row serves it back (list, retrieve, content) to its principal only."""

    file_id: str
    principal: str | None
    filename: str
    purpose: str
    bytes: int
    # Unix seconds, as the FileObject's `created_at`.
    created_at: int


class FileDeleted(Event, tag="file.deleted", frozen=True, kw_only=True):
    """`DELETE /v1/files/{id}`: the gateway deleted the content; the recorder marks the row deleted."""

    file_id: str
    principal: str | None


class BatchCreated(Event, tag="batch.created", frozen=True, kw_only=True):
    """`POST /v1/batches`: a batch of `input_file_id`'s lines against `endpoint`, owned by `principal`;
    a claim on the BATCHES work queue hands it to a gateway's batch runner."""

    batch_id: str
    principal: str | None
    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = None
    # Unix seconds.
    created_at: int
    expires_at: int


class BatchStatus(Event, tag="batch.status", frozen=True, kw_only=True):
    """A batch moved to `status` at `at` (Unix seconds); the ledger keeps the furthest status in
    OpenAI's order (validating < in_progress < cancelling < finalizing < terminal) and the first time
    of each. `total` is the batch's line count, once known; the file ids come with a terminal status."""

    batch_id: str
    status: str
    at: int
    total: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    # A batch that failed as a whole (e.g. its input file is gone): OpenAI's `errors.data`.
    errors: list[dict[str, Any]] | None = None


class BatchLine(Event, tag="batch.line", frozen=True, kw_only=True):
    """One finished line of a batch: its answer (`status_code` and `body`) or, for a line that never
    ran (invalid, expired), `error`. Its `event_id` is the batch id and line number, so a line
    published twice is recorded once; the ledger keeps one row per (batch, custom_id) too."""

    batch_id: str
    line: int
    custom_id: str | None
    status_code: int | None = None
    request_id: str | None = None
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None


class EventRef(Event, tag="event.ref", frozen=True, kw_only=True):
    """Published on EVENTS instead of an event too large for one bus message (a stored response
    of a long conversation, a bench run's artifacts): the encoded event is object `object` of the
    Object Store bucket `helexa_events` (`size` bytes, SHA-256 `digest` in hex). Same `event_id`,
    `ts`, `model` and `node` as the event, on the event's own subject; the recorder records the
    event itself, only if the object is still the one the reference names (the bucket is written by
    every role that publishes events; the subject, and so the digest, only by the event's own)."""

    ref_kind: str
    object: str
    size: int
    digest: str


class CoreRestarted(Event, tag="engine.restart", frozen=True, kw_only=True):
    """A model's engine core process died (not asked to) and what its worker did: started a new one
    (`restarted`), or not, `detail` saying why (a device fault, the restart budget spent, a new core
    that would not start): the model is then out of service on that worker until it is reloaded."""

    restarted: bool
    # The dead process's exit code (negative: the signal that ended it), if it could be read.
    exitcode: int | None = None
    # Requests the dead core held; each ended with an `engine_lost` error frame (which a gateway migrates).
    held_requests: int = 0
    # Restarts of this model's core within the budget's window, this one included, and the budget.
    restarts: int = 0
    max_restarts: int = 0
    restart_ms: float | None = None
    detail: str | None = None


AnyEvent = (RunStarted | RunFinished | RunPreempted | AdmissionDecided | NodeStatusChanged | BenchRunRecorded
            | ScoreRecorded | ResponseStored | ResponseDeleted | FileCreated | FileDeleted | BatchCreated | BatchStatus
            | BatchLine | EventRef | CoreRestarted)


def event_kind(event: Event) -> str:
    """The event's tag, which is also the `<kind>` part of its subject."""
    return kind_of(type(event))


def kind_of(event_type: type[Event]) -> str:
    """An event class's tag (`event_kind` of its events)."""
    tag = event_type.__struct_config__.tag
    if not isinstance(tag, str):  # every event class is declared with a string tag
        raise TypeError(f"{event_type.__name__} has no string tag")
    return tag

event_decoder = msgspec.json.Decoder(AnyEvent)

# The kinds a publisher may send several of in one EVENTS message (a JSON array of events, all of
# the kind and model its subject names): each request makes one or more of them, so on a busy
# node they come many a second (`apps.bus.event_publish`). Every other kind goes one to a
# message: a response's stored event is erased from the bus by its message (`erase_from_bus`).
BATCHED_KINDS = frozenset(kind_of(kind) for kind in (RunStarted, RunFinished, RunPreempted, AdmissionDecided))

_parts_decoder = msgspec.json.Decoder(list[msgspec.Raw])


def event_parts(data: bytes) -> list[bytes]:
    """The encoded events one EVENTS message carries: the message itself (one event), or each
    element of its JSON array. Raises msgspec.DecodeError when an array is not well formed."""
    if data[:1] != b"[":
        return [data]
    return [bytes(raw) for raw in _parts_decoder.decode(data)]


def batch_body(encoded: list[bytes]) -> bytes:
    """One EVENTS message's body for these encoded events (one alone is sent as itself)."""
    return encoded[0] if len(encoded) == 1 else b"[" + b",".join(encoded) + b"]"


def decode_events(data: bytes) -> list[AnyEvent]:
    """The events of one EVENTS message (`event_parts`), decoded."""
    return [event_decoder.decode(part) for part in event_parts(data)]

"""Wire types of the bus: requests, reply frames, events and node status, as JSON msgspec Structs.

Importing this module must stay cheap: no torch, no NATS client. A request carries the engine
protocol's `SamplingParams` as it is (the one definition of sampling), and the shared enums of
`apps.bus.codes` type every status, state, code and finish reason.
"""

from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from apps.bus.codes import Api, ErrorCode, FinishReason, ModelState, NodeState, RunStatus
from apps.bus.uuid7 import uuid7_hex
from engine.frontend.protocol import PreemptionReason, Priority, SamplingParams, ServiceClass


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every message body on the bus."""


# Longest error or detail text an event, a frame or a log line carries (UTF-8 bytes): an engine's
# error may quote a whole grammar, a client's input or a parser's state, and none of that belongs
# in a message whose size a client could then choose.
MAX_TEXT_BYTES = 1024


def bounded_text(text: str, limit: int = MAX_TEXT_BYTES) -> str:
    """`text` cut to at most `limit` UTF-8 bytes (on a character boundary), saying how much was cut."""
    raw = text.encode("utf-8", "replace")
    if len(raw) <= limit:
        return text
    note = f" … [{len(raw)} bytes, cut]"
    return raw[: max(limit - len(note.encode()), 0)].decode("utf-8", "ignore") + note


class ChatMessage(Wire, frozen=True, kw_only=True):
    role: str
    content: str
    # Assistant turns that called tools, and tool results answering them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class ResumedChoice(Wire, frozen=True, kw_only=True):
    """One choice of a migrated request as its client already has it: the token ids of every
    delta it was sent (`Delta.token_ids`, concatenated in order), and the choice's finish reason
    if a delta already finished it (such a choice is not run again)."""

    token_ids: list[int] = []
    finish_reason: FinishReason | None = None


class GenerateRequest(Wire, frozen=True, kw_only=True):
    """One client request as published on `helexa.req.<model>`; the bus speaks text (token ids
    only when a /v1/completions client sent a prompt as token ids)."""

    request_id: str
    model: str
    reply_subject: str
    sampling: SamplingParams
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    stream: bool = False
    principal: str | None = None
    api: Api = Api.CHAT_COMPLETIONS
    # Unix seconds after which nobody is waiting for the answer any more.
    deadline: float = 0.0
    attempt: int = 1
    created_at: float = msgspec.field(default_factory=time.time)
    # OpenAI-style tool definitions, handed to the chat template as `tools`.
    tools: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    # The requester answers on alive_subject(reply_subject), so workers can notice it is gone.
    liveness_probe: bool = False
    # The reply must open with a tool call: any tool (`tool_required`), or the one named.
    tool_required: bool = False
    tool_name: str | None = None
    # The conversation ends on an assistant turn that the model continues (Anthropic prefill).
    continue_final_message: bool = False
    # A migrated attempt (its first worker died mid-stream): one entry per choice, what the client
    # was already sent. The worker continues after it without sending any of it again; it counts
    # as generated (max_tokens, min_tokens, usage).
    resume: list[ResumedChoice] | None = None
    # Requests whose bodies the gateway was still reading when this one's was in: an idle
    # engine's batch window waits for them (engine.core.batch_window); 0 when none, or not known.
    arriving: int = 0
    # Priority classes (engine.core.scheduler): clients send interactive work; only the batch
    # feeder sends `batch`. `priority` orders requests within a class, lower first.
    service_class: ServiceClass = ServiceClass.INTERACTIVE
    priority: Priority = 0


class RequestRef(Wire, frozen=True, kw_only=True):
    """Published on `helexa.req.<model>` instead of a `GenerateRequest` too large for one bus
    message: the encoded request is the object `object` of the Object Store bucket
    `helexa_requests` (`size` bytes). See `apps.bus.large_requests`."""

    request_id: str
    model: str
    object: str
    size: int


class Usage(Wire, frozen=True, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0
    reasoning_tokens: int = 0


class Frame(Wire, tag_field="type", frozen=True, kw_only=True):
    """Worker → gateway reply frame; `seq` counts from 0 per attempt so gaps and repeats show."""

    seq: int
    attempt: int = 1


class Accepted(Frame, tag="accepted", frozen=True, kw_only=True):
    node: str
    prompt_tokens: int


class ToolCallDelta(Wire, frozen=True, kw_only=True):
    """A tool call the model made (Qwen `<tool_call>{json}</tool_call>`), sent whole once parsed."""

    index: int
    id: str
    name: str
    arguments: str


class TokenLogprobs(Wire, frozen=True, kw_only=True):
    token: str
    logprob: float
    bytes: list[int]
    top: list[tuple[str, float, list[int]]] = []


class Delta(Frame, tag="delta", frozen=True, kw_only=True):
    text: str
    num_tokens: int
    # Which of the request's n choices this text belongs to; set with the choice's last delta.
    index: int = 0
    finish_reason: FinishReason | None = None
    # Text inside <think>…</think>, never part of `text`.
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = []
    logprobs: list[TokenLogprobs] | None = None
    # Which of the request's stop strings ended this choice (with its last delta).
    stop_sequence: str | None = None
    # The token ids generated for this choice since its previous delta (text held back, e.g. a
    # possible stop string, may still be to come from them): a requester keeping them knows
    # exactly what its client was sent, and resumes a migrated request from them.
    token_ids: list[int] = []


class Heartbeat(Frame, tag="heartbeat", frozen=True, kw_only=True):
    pass


class Final(Frame, tag="final", frozen=True, kw_only=True):
    finish_reason: FinishReason
    usage: Usage


class ErrorFrame(Frame, tag="error", frozen=True, kw_only=True):
    status: int
    code: ErrorCode
    message: str


ReplyFrame = Accepted | Delta | Heartbeat | Final | ErrorFrame


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


class ModelStatus(Wire, frozen=True, kw_only=True):
    model: str
    max_model_len: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    slots: int = 0
    free_slots: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_queries: int = 0
    prefix_hits: int = 0
    # Priority classes: batch sequences running and waiting in the engine, and its preemptions by
    # reason since it started (engine.core.scheduler's two reasons).
    batch_running: int = 0
    batch_waiting: int = 0
    preemptions: dict[PreemptionReason, int] = {}
    # Hybrid models: linear-attention state slots in the engine, and how many are free.
    state_slots: int = 0
    free_state_slots: int = 0
    # "ready", or "poisoned" after a device fault (requests fail fast until a reload).
    state: ModelState = ModelState.READY
    detail: str | None = None
    prefill_tok_per_s: float | None = None
    # What the catalogue says the model needs (0: not from the catalogue, unknown).
    memory_mb: int = 0
    # Token ids the model's tokenizer knows (0: unknown), so the gateway can refuse others.
    vocab_size: int = 0
    # The engine's weight/activation dtype ("" unknown), measured at start on CPU.
    dtype: str = ""
    # Why that dtype, in a sentence ("" unknown): measured figures, or "bf16 unsupported here (...)".
    dtype_reason: str = ""
    # Model-runner ranks the engine shards the model across (`--tensor-parallel`).
    tensor_parallel: int = 1
    # Grammar compiles started for this model (the engine's, and the worker's checks of the tool
    # grammars it composes), and constrained requests that shared a compile done or under way.
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0


class NodeStatus(Wire, frozen=True, kw_only=True):
    """A worker's entry in the `helexa_nodes` bucket, rewritten every few seconds."""

    node: str
    models: list[ModelStatus]
    version: str
    status: NodeState = NodeState.READY
    updated_at: float = msgspec.field(default_factory=time.time)
    # Memory the worker offers for models, and what its loaded models leave of it.
    memory_mb: int = 0
    free_memory_mb: int = 0
    # Models being loaded now: not served yet.
    loading: list[str] = []


class TokenizeRequest(Wire, frozen=True, kw_only=True):
    """A question for a worker's `tokenize` endpoint about `model`: the prompt tokens a generation
    of `request` would feed the model (rendered and tokenized exactly as a generation does), or,
    with `token_ids`, the text of those tokens."""

    model: str
    request: GenerateRequest | None = None
    token_ids: list[int] | None = None
    # None: as generation does (chat: the template places special tokens; a prompt: added).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeError(Wire, frozen=True, kw_only=True):
    status: int
    code: ErrorCode
    message: str


class TokenizeReply(Wire, frozen=True, kw_only=True):
    """What a worker's `tokenize` endpoint answers: ids (tokenize) or text (detokenize), or an error."""

    model: str
    token_ids: list[int] = []
    text: str = ""
    token_strs: list[str] | None = None
    # The context the worker serves for the model (0: unknown).
    max_model_len: int = 0
    error: TokenizeError | None = None


_encoder = msgspec.json.Encoder()
encode = _encoder.encode
request_decoder = msgspec.json.Decoder(GenerateRequest)
_request_ref_decoder = msgspec.json.Decoder(RequestRef)


def decode_request(data: bytes) -> GenerateRequest | RequestRef:
    """A message of REQUESTS: a request, or a reference to one in the Object Store. Raises
    msgspec.DecodeError for anything else (the request's error, which names what it lacks)."""
    try:
        return request_decoder.decode(data)
    except msgspec.DecodeError as exc:
        try:
            return _request_ref_decoder.decode(data)
        except msgspec.DecodeError:
            raise exc from None
frame_decoder = msgspec.json.Decoder(ReplyFrame)
event_decoder = msgspec.json.Decoder(AnyEvent)
node_decoder = msgspec.json.Decoder(NodeStatus)
tokenize_request_decoder = msgspec.json.Decoder(TokenizeRequest)
tokenize_reply_decoder = msgspec.json.Decoder(TokenizeReply)

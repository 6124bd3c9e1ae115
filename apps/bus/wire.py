"""Wire types of the bus: requests, reply frames, model and node status and tokenize calls, as JSON msgspec
Structs (the events are `apps.bus.events`).

Importing this module must stay cheap: no torch, no NATS client. A request carries the engine
protocol's `SamplingParams` as it is (the one definition of sampling), and the shared enums of
`apps.bus.codes` type every status, state, code and finish reason.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Generic, TypeVar

import msgspec
from msgspec import Meta

from apps.bus.codes import Api, ErrorCode, FinishReason, ModelState, NodeState
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


# A message's role is one of a few words at every edge; a bus client's is held to this.
MAX_ROLE_CHARS = 32
# What a chat template adds around each message (its role's markers and separators), counted as
# characters of text: a request of many empty messages is no smaller than it renders.
MESSAGE_OVERHEAD_CHARS = 8


# Extra variables for the chat template (vLLM's `chat_template_kwargs`; Qwen3's `enable_thinking`):
# at most this many, each named like a template variable, in at most this many bytes of JSON, and
# none of the variables the worker itself gives the template.
MAX_TEMPLATE_KWARGS = 16
MAX_TEMPLATE_KWARGS_BYTES = 4096
TEMPLATE_KWARG_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
TEMPLATE_OWN_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


def template_kwargs_problem(kwargs: dict[str, Any]) -> str | None:
    """What is wrong with `kwargs` as extra template variables, or None: the same check at the
    gateway (a 400 naming the field) and at the worker (for any bus client)."""
    if len(kwargs) > MAX_TEMPLATE_KWARGS:
        return f"at most {MAX_TEMPLATE_KWARGS} variables"
    for name in kwargs:
        if not isinstance(name, str) or re.fullmatch(TEMPLATE_KWARG_NAME, name) is None:
            return "each name must be an identifier of at most 64 characters"
        if name in TEMPLATE_OWN_VARIABLES:
            return f"'{name}' is set by the server"
    if len(msgspec.json.encode(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
        return f"at most {MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON"
    return None


class ChatMessage(Wire, frozen=True, kw_only=True):
    role: Annotated[str, Meta(max_length=MAX_ROLE_CHARS)]
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
    # At most one tool call in the reply (`parallel_tool_calls: false`, Anthropic's
    # `disable_parallel_tool_use`): the choice ends once its first call is whole.
    single_tool_call: bool = False
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
    # Extra chat template variables (`template_kwargs_problem` bounds them), e.g. enable_thinking.
    template_kwargs: dict[str, Any] | None = None

    def text_chars(self) -> int:
        """Characters of text the chat template renders and the tokenizer reads for this request:
        the prompt, every message's role, content, name, tool-call id and tool calls (names, ids
        and arguments, as JSON) with `MESSAGE_OVERHEAD_CHARS` for its markers, the tools' JSON, the
        forced tool's name and the extra template variables' JSON. What bounds a prompt before it
        is tokenized counts all of it, so no field the template renders can grow unseen."""
        chars = len(self.prompt or "") + (len(msgspec.json.encode(self.tools)) if self.tools else 0)
        chars += len(self.tool_name or "")
        chars += len(msgspec.json.encode(self.template_kwargs)) if self.template_kwargs else 0
        for message in self.messages or ():
            chars += MESSAGE_OVERHEAD_CHARS + len(message.role) + len(message.content)
            chars += len(message.name or "") + len(message.tool_call_id or "")
            if message.tool_calls:
                chars += len(msgspec.json.encode(message.tool_calls))
        return chars


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
    # Each rank's engine steps and their seconds, by rank (tensor_parallel entries; /metrics'
    # helexa:engine_step_seconds).
    rank_steps: list[int] = []
    rank_step_seconds: list[float] = []
    # Threads the engine's CPU steps run on now (0: a GPU, or unknown); /metrics' helexa:engine_cpu_threads.
    cpu_threads: int = 0
    # Grammar compiles started for this model (the engine's, and the worker's checks of the tool
    # grammars it composes), and constrained requests that shared a compile done or under way.
    grammar_compiles: int = 0
    grammar_cache_hits: int = 0
    # Requests this worker pulled for the model since it started, by service class.
    pulled: dict[ServiceClass, int] = {}


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
    # Only how many tokens (`TokenizeReply.count`), not the ids: a count of a long context is a
    # few bytes on the bus, where its ids are ~6 bytes each.
    count_only: bool = False


class TokenizeError(Wire, frozen=True, kw_only=True):
    status: int
    code: ErrorCode
    message: str


class TokenizeReply(Wire, frozen=True, kw_only=True):
    """What a worker's `tokenize` endpoint answers: ids (tokenize) or text (detokenize), or an error."""

    model: str
    token_ids: list[int] = []
    # How many tokens, answering `count_only` (None from a worker that sends the ids instead).
    count: int | None = None
    text: str = ""
    token_strs: list[str] | None = None
    # The context the worker serves for the model (0: unknown).
    max_model_len: int = 0
    error: TokenizeError | None = None


_encoder = msgspec.json.Encoder()
encode = _encoder.encode
T = TypeVar("T")


class BodyDecoder(Generic[T]):
    """A msgspec JSON decoder for bodies from other processes, whose every failure is a
    msgspec.DecodeError: JSON nested past the interpreter's recursion limit (about 1,000 levels,
    2 KB of brackets) raised RecursionError, which the readers did not expect (a worker's intake
    ended on it)."""

    def __init__(self, kind: type[T]) -> None:
        self._decoder = msgspec.json.Decoder(kind)

    def decode(self, data: bytes | str) -> T:
        try:
            return self._decoder.decode(data)
        except RecursionError:
            raise msgspec.DecodeError("JSON nested too deeply") from None


request_decoder = BodyDecoder(GenerateRequest)
_request_ref_decoder = BodyDecoder(RequestRef)


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


frame_decoder: BodyDecoder[ReplyFrame] = BodyDecoder(ReplyFrame)  # type: ignore[arg-type]  # a union of frame types
node_decoder = BodyDecoder(NodeStatus)
tokenize_request_decoder = BodyDecoder(TokenizeRequest)
tokenize_reply_decoder = BodyDecoder(TokenizeReply)

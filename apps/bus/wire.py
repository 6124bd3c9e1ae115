"""Wire types of the bus: requests, reply frames, events and node status, as JSON msgspec Structs.

Importing this module must stay cheap: no torch, no NATS client.
"""

from __future__ import annotations

import time
import uuid

import msgspec


class Wire(msgspec.Struct, frozen=True, kw_only=True):
    """Base of every message body on the bus."""


class ChatMessage(Wire, kw_only=True):
    role: str
    content: str


class Sampling(Wire, kw_only=True):
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None
    n: int = 1


class GenerateRequest(Wire, kw_only=True):
    """One client request as published on `helexa.req.<model>`; the bus speaks text, not tokens."""

    request_id: str
    model: str
    reply_subject: str
    sampling: Sampling
    messages: list[ChatMessage] | None = None
    prompt: str | None = None
    stream: bool = False
    principal: str | None = None
    api: str = "chat.completions"
    # Unix seconds after which nobody is waiting for the answer any more.
    deadline: float = 0.0
    attempt: int = 1
    created_at: float = msgspec.field(default_factory=time.time)


class Usage(Wire, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    queue_ms: float = 0.0
    prefill_ms: float = 0.0
    decode_ms: float = 0.0


class Frame(Wire, tag_field="type", kw_only=True):
    """Worker → gateway reply frame; `seq` counts from 0 per attempt so gaps and repeats show."""

    seq: int
    attempt: int = 1


class Accepted(Frame, tag="accepted", kw_only=True):
    node: str
    prompt_tokens: int


class Delta(Frame, tag="delta", kw_only=True):
    text: str
    num_tokens: int
    # Which of the request's n choices this text belongs to; set with the choice's last delta.
    index: int = 0
    finish_reason: str | None = None


class Heartbeat(Frame, tag="heartbeat", kw_only=True):
    pass


class Final(Frame, tag="final", kw_only=True):
    finish_reason: str
    usage: Usage


class ErrorFrame(Frame, tag="error", kw_only=True):
    status: int
    code: str
    message: str


ReplyFrame = Accepted | Delta | Heartbeat | Final | ErrorFrame


class Event(Wire, tag_field="kind", kw_only=True):
    """Something that happened, published on EVENTS; `event_id` makes replays idempotent."""

    event_id: str = msgspec.field(default_factory=lambda: uuid.uuid4().hex)
    ts: float = msgspec.field(default_factory=time.time)
    model: str
    node: str


class RunStarted(Event, tag="run.started", kw_only=True):
    request_id: str
    api: str
    principal: str | None
    prompt_tokens: int
    attempt: int
    queue_ms: float


class RunFinished(Event, tag="run.finished", kw_only=True):
    request_id: str
    api: str
    principal: str | None
    status: str
    finish_reason: str
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


AnyEvent = RunStarted | RunFinished


class ModelStatus(Wire, kw_only=True):
    model: str
    max_model_len: int | None = None
    max_input_tokens: int | None = None
    max_output_tokens: int | None = None
    slots: int = 0
    free_slots: int = 0


class NodeStatus(Wire, kw_only=True):
    """A worker's entry in the `helexa_nodes` bucket, rewritten every few seconds."""

    node: str
    models: list[ModelStatus]
    version: str
    status: str = "ready"
    updated_at: float = msgspec.field(default_factory=time.time)


_encoder = msgspec.json.Encoder()
encode = _encoder.encode
request_decoder = msgspec.json.Decoder(GenerateRequest)
frame_decoder = msgspec.json.Decoder(ReplyFrame)
event_decoder = msgspec.json.Decoder(AnyEvent)
node_decoder = msgspec.json.Decoder(NodeStatus)

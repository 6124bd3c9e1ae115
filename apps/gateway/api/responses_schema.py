"""OpenAI Responses API shapes as msgspec Structs: the request with its input items, and the
response object with its output items, as the `openai` SDK's `types.responses` define them.

Input items are tagged by `type`; a message may leave it out, so items are decoded one at a time
(`InputItem`), after `type` defaults to "message". A field we cannot honour is accepted by the
schema only so that it can be refused by name, never dropped.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from apps.gateway.api.validate import MAX_MESSAGES, MAX_TOOLS, ModelId
from engine.frontend import protocol as p

MAX_RESPONSE_ID_BYTES = 128
# Ids, call ids and names a client sends in input items, and their statuses: stored with the
# response, so bounded (OpenAI's own are a few dozen characters).
MAX_ITEM_ID_CHARS = 256
MAX_STATUS_CHARS = 32
# `user`, echoed and stored (OpenAI's `safety_identifier`, its successor, is at most 64).
MAX_USER_CHARS = 256
ItemId = Annotated[str, Meta(max_length=MAX_ITEM_ID_CHARS)]
Status = Annotated[str, Meta(max_length=MAX_STATUS_CHARS)]


class InputText(msgspec.Struct, kw_only=True, tag_field="type", tag="input_text"):
    text: str


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[dict[str, Any]] = []
    logprobs: list[dict[str, Any]] | None = None


class Refusal(msgspec.Struct, kw_only=True, tag_field="type", tag="refusal"):
    refusal: str


class InputImage(msgspec.Struct, kw_only=True, tag_field="type", tag="input_image"):
    """Accepted by the schema only so that it can be refused by name."""


class InputFile(msgspec.Struct, kw_only=True, tag_field="type", tag="input_file"):
    """Accepted by the schema only so that it can be refused by name."""


ContentPart = InputText | OutputText | Refusal | InputImage | InputFile


class MessageItem(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: ItemId | None = None
    status: Status | None = None


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    """A function call the model made, as an output item and as input sent back in a later turn."""

    call_id: ItemId
    name: ItemId
    arguments: str
    # The `namespace` tool the function belongs to (`responses_tools`).
    namespace: ItemId | None = None
    id: ItemId | None = None
    status: Status | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call_output"):
    call_id: ItemId
    output: str | list[ContentPart]
    id: ItemId | None = None
    status: Status | None = None


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    """Reasoning (text inside `<think>`): an output item, and input that is not shown to the model
    again (as with Anthropic thinking blocks)."""

    id: ItemId | None = None
    summary: list[dict[str, Any]] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: Status | None = None


class ItemReference(msgspec.Struct, kw_only=True, tag_field="type", tag="item_reference"):
    """Accepted by the schema only so that it can be refused by name."""

    id: ItemId = ""


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem | ItemReference


class FunctionTool(msgspec.Struct, kw_only=True, tag_field="type", tag="function"):
    """A function tool; how other tool types are treated is `responses_tools`' to say."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamespaceTool(msgspec.Struct, kw_only=True, tag_field="type", tag="namespace"):
    """Function tools grouped under a name (`openai.types.responses.NamespaceTool`)."""

    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str = ""
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)]


class TextFormat(msgspec.Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(msgspec.Struct, kw_only=True, omit_defaults=True):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """The fields we act on; unknown fields are accepted and ignored, as OpenAI clients expect."""

    model: ModelId
    # Text, or items decoded one by one (`InputItem`): a message may leave its `type` out.
    input: str | Annotated[list[dict[str, Any]], Meta(max_length=MAX_MESSAGES)] = []
    instructions: str | None = None
    previous_response_id: Annotated[str, Meta(min_length=1, max_length=MAX_RESPONSE_ID_BYTES)] | None = None
    store: bool = True
    stream: bool = False
    max_output_tokens: p.TokenCount | None = None
    temperature: p.Temperature | None = None
    top_p: p.TopP | None = None
    # Order among this server's interactive requests, lower first (vLLM's `priority`).
    priority: p.Priority = 0
    top_logprobs: p.TopLogprobs | None = None
    # Tools by type, read by `responses_tools`: functions, namespaces of functions, hosted tools.
    tools: Annotated[list[dict[str, Any]], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    metadata: Annotated[dict[str, str], Meta(max_length=16)] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    user: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    # Accepted and ignored (docs/api.md): there is one service tier, no tool loop on the server,
    # and the prefix cache needs no key.
    prompt_cache_key: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: Annotated[str, Meta(max_length=MAX_USER_CHARS)] | None = None
    service_tier: str | None = None
    max_tool_calls: Annotated[int, Meta(ge=1)] | None = None
    client_metadata: Any = None
    stream_options: dict[str, Any] | None = None
    # Refused when set: nothing here runs a response in the background, holds a conversation
    # object or a stored prompt template.
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]
    role: str = "assistant"


class OutputFunctionCall(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]
    namespace: str | None = None


class OutputReasoning(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    content: list[ReasoningText]
    status: Literal["in_progress", "completed", "incomplete"]
    summary: list[dict[str, Any]] = []
    # We never encrypt reasoning: its text is in `content`.
    encrypted_content: str | None = None


OutputItem = OutputMessage | OutputFunctionCall | OutputReasoning


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseError(msgspec.Struct, kw_only=True):
    code: str
    message: str


class ResponseObject(msgspec.Struct, kw_only=True):
    """The response: what `POST /v1/responses` answers (and streams snapshots of), what `GET`
    returns, and what the ledger stores."""

    id: str
    object: str = "response"
    created_at: int
    status: Literal["completed", "failed", "in_progress", "cancelled", "queued", "incomplete"]
    error: ResponseError | None = None
    incomplete_details: dict[str, str] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = []
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    temperature: float | None = None
    text: TextConfig | None = None
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = []
    top_p: float | None = None
    top_logprobs: int | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = {}
    background: bool = False
    completed_at: int | None = None


class DeletedResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "response"
    deleted: bool = True

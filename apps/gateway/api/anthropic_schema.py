"""Anthropic Messages request and response shapes as msgspec Structs, and the Anthropic error envelope."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from apps.bus.codes import ErrorCode, FinishReason, ServingError
from apps.gateway.api.structured import json_constraint
from apps.gateway.api.validate import MAX_MESSAGES, MAX_TOOLS, ModelId, check_stop_strings
from engine.frontend.protocol import SamplingParams, StopStrings, TokenCount, TopK, TopP


class TextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="image"):
    """Accepted by the schema only so that it can be refused by name."""


class DocumentBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="document"):
    """Accepted by the schema only so that it can be refused by name."""


class ToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_result"):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: str | list[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="redacted_thinking"):
    data: str = ""


ContentBlockIn = (
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
)


class MessageIn(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlockIn]


class ToolIn(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[a-zA-Z0-9_-]{1,128}$")]
    description: str | None = None
    input_schema: dict[str, Any]
    # Absent or "custom" for client tools; Anthropic's server tools ("bash_20250124", ...) set it.
    type: str | None = None
    # Calls of a strict tool are held to `input_schema` (apps/gateway/api/structured.py).
    strict: bool | None = None


class JsonOutputFormat(msgspec.Struct, kw_only=True, tag_field="type", tag="json_schema"):
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    """What the answer looks like: `format` holds it to a JSON schema (structured outputs); other
    keys (`effort`) are accepted and not acted on."""

    format: JsonOutputFormat | None = None


class ToolChoiceAuto(msgspec.Struct, kw_only=True, tag_field="type", tag="auto"):
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(msgspec.Struct, kw_only=True, tag_field="type", tag="any"):
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(msgspec.Struct, kw_only=True, tag_field="type", tag="tool"):
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(msgspec.Struct, kw_only=True, tag_field="type", tag="none"):
    pass


ToolChoice = ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone


class Metadata(msgspec.Struct, kw_only=True):
    user_id: str | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: Annotated[str, Meta(max_length=32)]

    def switch(self) -> bool | None:
        return {"enabled": True, "adaptive": True, "disabled": False}.get(self.type)


class MessagesRequest(msgspec.Struct, kw_only=True):
    """The parameters we act on; unknown fields are accepted and ignored, as Anthropic clients expect."""

    model: ModelId
    max_tokens: TokenCount
    messages: Annotated[list[MessageIn], Meta(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    stop_sequences: StopStrings | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    tools: Annotated[list[ToolIn], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    metadata: Metadata | None = None
    output_config: OutputConfig | None = None
    # Extended thinking: `enabled` / `disabled` turn a thinking template's reasoning on or off
    # (enable_thinking); left out, the template's own default holds. Its budget is not acted on.
    thinking: ThinkingConfig | None = None
    # The structured-outputs beta's spelling of `output_config.format`.
    output_format: JsonOutputFormat | None = None

    def constraint_param(self) -> str | None:
        """The field the answer's JSON schema came in (for a 400 naming it), if any."""
        if self.output_config is not None and self.output_config.format is not None:
            return "output_config.format"
        return "output_format" if self.output_format is not None else None

    def sampling_params(self) -> SamplingParams:
        """Anthropic's sampling fields under their `SamplingParams` names; null means the default."""
        stops = check_stop_strings(self.stop_sequences or [], "stop_sequences")
        given: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}
        configured = self.output_config.format if self.output_config is not None else None
        if configured is not None and self.output_format is not None:
            raise ServingError(400, ErrorCode.INVALID_REQUEST, "Give the answer's JSON schema once: "
                               "'output_config.format' or 'output_format', not both.", param="output_format")
        chosen = configured or self.output_format
        if chosen is not None:
            given["structured"] = json_constraint(chosen.schema, self.constraint_param() or "output_format")
        return SamplingParams(max_tokens=self.max_tokens, stop=list(stops),
                              **{name: value for name, value in given.items() if value is not None})


class TextOut(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingOut(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    thinking: str
    # We cannot sign reasoning; clients round-trip the empty string and we ignore it.
    signature: str = ""


class ToolUseOut(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


ContentBlockOut = TextOut | ThinkingOut | ToolUseOut


class UsageOut(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


class MessageOut(msgspec.Struct, kw_only=True):
    id: str
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[ContentBlockOut]
    stop_reason: str | None
    stop_sequence: str | None = None
    usage: UsageOut


STOP_REASONS = {FinishReason.STOP: "end_turn", FinishReason.LENGTH: "max_tokens", FinishReason.TOOL_CALLS: "tool_use",
                FinishReason.ABORT: "end_turn"}

# Only the types the anthropic SDK's `ErrorObject` union knows (a body too large is an invalid request).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}


def error_body(status: int, message: str) -> dict[str, Any]:
    """The Anthropic error envelope: `{"type": "error", "error": {"type", "message"}}`."""
    kind = _ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class ErrorDetail(msgspec.Struct, kw_only=True):
    type: str
    message: str


class ErrorEnvelope(msgspec.Struct, kw_only=True):
    """What every failed `/v1/messages` request answers (documented in the OpenAPI schema)."""

    type: str = "error"
    error: ErrorDetail
